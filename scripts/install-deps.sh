#!/usr/bin/env bash
# Installs the Debian packages the tests and the demo start servers from, when they are missing.
# Needs root (apt-get); does nothing when everything is already there.
set -euo pipefail

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || missing+=(postgresql)
python3 -c "import venv, ensurepip" >/dev/null 2>&1 || missing+=(python3-venv)
# promtool checks and unit-tests the shipped alert rules; Debian ships it in "prometheus".
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
# The RabbitMQ scenarios start a private broker from Debian's rabbitmq-server (as the test user).
[ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || missing+=(rabbitmq-server)
# The PgBouncer scenarios (transaction pooling) start a private pooler from /usr/sbin/pgbouncer.
[ -x /usr/sbin/pgbouncer ] || missing+=(pgbouncer)
# The clock-skew scenario runs a worker under libfaketime (LD_PRELOAD, FAKETIME=+30s).
compgen -G "/usr/lib/*/faketime/libfaketime.so.1" >/dev/null || missing+=(libfaketime)

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "missing Debian packages: ${missing[*]}; run as root or: sudo apt-get install ${missing[*]}" >&2
  exit 1
fi
echo "installing Debian packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# The packages' own services are not used: the tests and the demo start private servers.
# A policy-rc.d that refuses every start keeps the postinst scripts (prometheus's,
# rabbitmq-server's and pgbouncer's especially) from starting system servers: invoke-rc.d and
# deb-systemd-invoke both ask it, and a start it refuses is not a failed install. Docker images
# ship one; elsewhere we add one for the install.
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
  chmod 755 /usr/sbin/policy-rc.d
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi
apt-get install -y -q --no-install-recommends "${missing[@]}"
# Under systemd, also keep the prometheus server from starting at the next boot.
if [[ " ${missing[*]} " == *" prometheus "* ]] && [ -d /run/systemd/system ]; then
  systemctl disable --now prometheus.service >/dev/null 2>&1 || true
fi
if [[ " ${missing[*]} " == *" rabbitmq-server "* ]] && [ -d /run/systemd/system ]; then
  systemctl disable --now rabbitmq-server.service epmd.socket epmd.service >/dev/null 2>&1 || true
fi
if [[ " ${missing[*]} " == *" pgbouncer "* ]] && [ -d /run/systemd/system ]; then
  systemctl disable --now pgbouncer.service pgbouncer.socket >/dev/null 2>&1 || true
fi
