"""Private PostgreSQL, PgBouncer and Redis servers, one per test session, as child processes.

Each runs in its own session/process group, is registered for atexit cleanup and is
stopped by PID. Startup waits are bounded; failures raise RuntimeError with the log tail.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import quote

import psycopg
import redis
from psycopg import sql

from . import procs
from .ports import free_port


def _pg_bin() -> Path:
    """The newest installed PostgreSQL's bin directory (Debian installs one per major version)."""
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"),
        key=lambda path: int(path.parent.parent.name) if path.parent.parent.name.isdigit() else 0,
    )
    return found[-1].parent if found else Path("/usr/lib/postgresql/15/bin")


PG_BIN = _pg_bin()
REDIS_SERVER = "/usr/bin/redis-server"
PG_TEST_DB = "celery_guard_test"
PG_SERVICE_USER = "celerytest"


def _pg_os_user() -> str | None:
    """The unprivileged account to run PostgreSQL as, or None when we are not root.

    PostgreSQL refuses to run as root. Prefer the distro's ``postgres`` account; otherwise
    use (and if needed create) a dedicated system user.
    """
    if os.geteuid() != 0:
        return None
    for name in ("postgres", PG_SERVICE_USER):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    subprocess.run(
        ["useradd", "--system", "--no-create-home", PG_SERVICE_USER],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return PG_SERVICE_USER


def _user_kwargs(user: str | None) -> dict[str, Any]:
    """Popen arguments that drop root to ``user`` (Popen does setgroups/setgid/setuid)."""
    if user is None:
        return {}
    entry = pwd.getpwnam(user)
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


def _clean_env(**extra: str) -> dict[str, str]:
    """os.environ without PG* variables (they would redirect psql/initdb) plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(extra)
    return env


_S = TypeVar("_S", bound="_ServerBase")


class _ServerBase:
    """Shared lifecycle: Popen in a new session, log file, registry, context manager."""

    name = "server"

    def __init__(self, port: int | None = None) -> None:
        self._port = port or free_port()
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: Path | None = None

    @property
    def port(self) -> int:
        return self._port

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError(f"{self.name} is not running")
        return self._proc.pid

    @property
    def log_path(self) -> Path:
        assert self._tmp is not None, f"{self.name} was never started"
        return self._tmp / f"{self.name}.log"

    def _spawn(self, argv: list[str], **kwargs: Any) -> None:
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **kwargs,
            )
        procs.register(self)

    def _fail(self, message: str) -> RuntimeError:
        tail = procs.log_tail(self.log_path) if self._tmp else ""
        return RuntimeError(
            f"{self.name} on port {self._port}: {message}\n--- log tail ---\n{tail}"
        )

    def _wait_ready(self, probe: Callable[[], bool], timeout: float) -> None:
        """Poll ``probe()`` (True when ready) until timeout; fail fast if the process died."""

        def ready() -> bool:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(f"exited with code {self._proc.returncode} during startup")
            return bool(probe())

        try:
            procs.wait_until(ready, timeout, f"{self.name} to accept connections", 0.1)
        except Exception as exc:
            err = self._fail(str(exc))
            self._abort()
            raise err from None

    def _abort(self) -> None:
        """Kill everything and drop the temp dir after a failed start."""
        self.emergency_kill()
        procs.unregister(self)

    def _shutdown(self, sig: int, timeout: float) -> None:
        if self._proc is not None:
            procs.terminate_tree(self._proc, sig, timeout)
            self._proc = None
        procs.unregister(self)

    def emergency_kill(self) -> None:
        procs.kill_tree_now(self._proc)
        self._proc = None
        procs.remove_tree(self._tmp)
        self._tmp = None

    def freeze(self) -> None:
        """SIGSTOP the server and all its descendants (e.g. every postgres backend)."""
        procs.signal_tree(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        procs.signal_tree(self.pid, signal.SIGCONT)

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self: _S) -> _S:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class PostgresServer(_ServerBase):
    """A throwaway PostgreSQL 15 cluster (trust auth, fsync off) on 127.0.0.1:port.

    ``durable=True`` runs it as production does instead: fsync, synchronous_commit and
    full_page_writes on, so every commit waits for its WAL flush (bench/overhead.py).
    """

    name = "postgres"

    def __init__(
        self, port: int | None = None, start_timeout: float = 30, durable: bool = False
    ) -> None:
        super().__init__(port)
        self.start_timeout = start_timeout
        self.durable = durable
        self._os_user = _pg_os_user()

    @property
    def url(self) -> str:
        """SQLAlchemy URL of the ``celery_guard_test`` database."""
        return self.url_for(PG_TEST_DB)

    def url_for(self, dbname: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self._port}/{dbname}"

    def dsn_for(self, dbname: str = PG_TEST_DB) -> str:
        """libpq/psycopg connection string (no SQLAlchemy driver suffix)."""
        return f"postgresql://postgres@127.0.0.1:{self._port}/{dbname}"

    def _connect_admin(self, connect_timeout: int = 5) -> psycopg.Connection[Any]:
        return psycopg.connect(
            self.dsn_for("postgres"), autocommit=True, connect_timeout=connect_timeout
        )

    def start(self) -> None:
        """initdb into a fresh temp dir, start postgres, create ``celery_guard_test``."""
        if self._proc is not None:
            return
        self._tmp = Path(tempfile.mkdtemp(prefix="rig-pg-"))
        (self._tmp / "sock").mkdir()
        if self._os_user is not None:
            entry = pwd.getpwnam(self._os_user)
            for p in (self._tmp, self._tmp / "sock"):
                os.chown(p, entry.pw_uid, entry.pw_gid)
        procs.register(self)  # so the temp dir is removed even if initdb fails
        with open(self.log_path, "ab") as log:
            result = subprocess.run(
                [
                    str(PG_BIN / "initdb"),
                    "-D",
                    str(self._tmp / "data"),
                    "--auth=trust",
                    "-U",
                    "postgres",
                    "--encoding=UTF8",
                    "--locale=C",
                    "--no-sync",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._tmp,
                env=_clean_env(LC_ALL="C"),
                timeout=120,
                check=False,
                **_user_kwargs(self._os_user),
            )
        if result.returncode != 0:
            err = self._fail(f"initdb failed with code {result.returncode}")
            self._abort()
            raise err
        self._run_postgres()
        with self._connect_admin() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(PG_TEST_DB)))

    def _run_postgres(self) -> None:
        assert self._tmp is not None
        argv = [str(PG_BIN / "postgres"), "-D", str(self._tmp / "data")]
        argv += ["-p", str(self._port), "-k", str(self._tmp / "sock")]
        durability = "on" if self.durable else "off"
        for setting in (
            "listen_addresses=127.0.0.1",
            f"fsync={durability}",
            f"synchronous_commit={durability}",
            f"full_page_writes={durability}",
            "max_connections=300",
            "shared_buffers=64MB",
        ):
            argv += ["-c", setting]
        self._spawn(argv, cwd=self._tmp, env=_clean_env(LC_ALL="C"), **_user_kwargs(self._os_user))

        data_dir = str(self._tmp / "data")

        def accepts() -> bool:
            # Compare the data directory so we never mistake another server on the port for ours.
            try:
                with self._connect_admin(connect_timeout=2) as conn:
                    row = conn.execute("SHOW data_directory").fetchone()
            except psycopg.OperationalError:
                return False
            return row is not None and row[0] == data_dir

        self._wait_ready(accepts, self.start_timeout)

    def create_database(self, name: str) -> str:
        """Create a fresh database and return its SQLAlchemy URL."""
        with self._connect_admin() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url_for(name)

    def create_password_role(self, role: str, password: str, dbname: str) -> str:
        """A login role that must give ``password`` over TCP (SCRAM; everyone else keeps trust
        auth), owning a new database ``dbname``; returns its SQLAlchemy URL with the password."""
        with self._connect_admin() as conn:
            conn.execute(
                sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                    sql.Identifier(role), sql.Literal(password)
                )
            )
            conn.execute(
                sql.SQL("CREATE DATABASE {} OWNER {}").format(
                    sql.Identifier(dbname), sql.Identifier(role)
                )
            )
            row = conn.execute("SHOW hba_file").fetchone()
            assert row is not None
            hba = Path(row[0])
            rule = f"host all {role} 127.0.0.1/32 scram-sha-256\n"
            hba.write_text(rule + hba.read_text())  # first match wins: before the trust lines
            conn.execute("SELECT pg_reload_conf()")
        url = (
            f"postgresql+psycopg://{role}:{quote(password, safe='')}@127.0.0.1:{self._port}/"
            f"{dbname}"
        )

        def password_required() -> bool:
            # The reload is asynchronous: wait until a wrong password is refused.
            try:
                psycopg.connect(
                    f"host=127.0.0.1 port={self._port} dbname={dbname} user={role} password=wrong",
                    connect_timeout=2,
                ).close()
            except psycopg.OperationalError:
                return True
            return False

        procs.wait_until(password_required, 10, f"PostgreSQL to ask {role} for a password")
        return url

    def stop(self, keep_data: bool = False) -> None:
        """Fast shutdown (SIGINT), SIGKILL after 15 s; removes the data dir unless told not to."""
        self._shutdown(signal.SIGINT, 15)
        if not keep_data:
            procs.remove_tree(self._tmp)
            self._tmp = None

    def restart(self) -> None:
        """Stop and start again on the same port with the same data (connections are lost)."""
        self.stop(keep_data=True)
        self._run_postgres()


PGBOUNCER = "/usr/sbin/pgbouncer"


class PgBouncerServer(_ServerBase):
    """PgBouncer (Debian's 1.18) on 127.0.0.1:port in front of a rig's PostgreSQL.

    ``pool_mode = transaction``: each transaction gets whichever server session is free, as in
    the deployments docs/pgbouncer.md describes. Every database of the PostgreSQL server is
    reachable under its own name (the ``*`` fallback), as ``postgres`` without a password.
    Like PostgreSQL, it refuses to run as root: it runs as the same unprivileged account.
    """

    name = "pgbouncer"

    def __init__(
        self,
        postgres: PostgresServer,
        port: int | None = None,
        start_timeout: float = 30,
        pool_mode: str = "transaction",
        pool_size: int = 20,
    ) -> None:
        super().__init__(port)
        self.postgres = postgres
        self.start_timeout = start_timeout
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self._os_user = _pg_os_user()

    def url_for(self, dbname: str) -> str:
        """The SQLAlchemy URL of ``dbname`` through PgBouncer."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self._port}/{dbname}"

    def through(self, direct_url: str) -> str:
        """``direct_url`` (a database of :attr:`postgres`) reached through PgBouncer instead."""
        return self.url_for(direct_url.rsplit("/", 1)[1])

    def serve(self, direct_url: str, timeout: str = "5s") -> str:
        """``direct_url``'s database through PgBouncer, its timeouts set on the role there.

        Behind a transaction pooler the engine sends no startup ``options``; the timeouts a
        deployment sets with ``ALTER ROLE ... IN DATABASE ... SET`` (docs/pgbouncer.md) apply
        to every server session PgBouncer opens for the database.
        """
        dbname = direct_url.rsplit("/", 1)[1]
        with self.postgres._connect_admin() as conn:
            for setting in ("statement_timeout", "lock_timeout"):
                conn.execute(
                    sql.SQL("ALTER ROLE postgres IN DATABASE {} SET {} = {}").format(
                        sql.Identifier(dbname), sql.Identifier(setting), sql.Literal(timeout)
                    )
                )
        return self.url_for(dbname)

    def _config(self) -> str:
        assert self._tmp is not None
        return "\n".join(
            [
                "[databases]",
                f"* = host=127.0.0.1 port={self.postgres.port}",
                "[pgbouncer]",
                "listen_addr = 127.0.0.1",
                f"listen_port = {self._port}",
                "unix_socket_dir =",
                "auth_type = trust",
                f"auth_file = {self._tmp / 'users.txt'}",
                f"pool_mode = {self.pool_mode}",
                # Workers (a hot, a pooled and a liveness connection per process), the test
                # process and the CLI; server sessions are what transaction pooling shares.
                "max_client_conn = 1000",
                f"default_pool_size = {self.pool_size}",
                "max_db_connections = 100",
                f"pidfile = {self._tmp / 'pgbouncer.pid'}",
                "admin_users = postgres",
                "",
            ]
        )

    def start(self) -> None:
        if self._proc is not None:
            return
        self._tmp = Path(tempfile.mkdtemp(prefix="rig-pgbouncer-"))
        procs.register(self)
        (self._tmp / "users.txt").write_text('"postgres" ""\n')
        (self._tmp / "pgbouncer.ini").write_text(self._config())
        if self._os_user is not None:
            entry = pwd.getpwnam(self._os_user)
            for path in (self._tmp, self._tmp / "users.txt", self._tmp / "pgbouncer.ini"):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        # In the foreground (no -d), so the Popen child is PgBouncer itself.
        self._spawn(
            [PGBOUNCER, str(self._tmp / "pgbouncer.ini")],
            cwd=self._tmp,
            env=_clean_env(),
            **_user_kwargs(self._os_user),
        )

        def accepts() -> bool:
            # SHOW through the admin console names our own PID: never another pooler's port.
            try:
                with psycopg.connect(
                    f"host=127.0.0.1 port={self._port} dbname=pgbouncer user=postgres",
                    autocommit=True,
                    connect_timeout=2,
                ) as conn:
                    conn.execute("SHOW VERSION")
                    return self._mode() == self.pool_mode
            except psycopg.Error:
                return False

        self._wait_ready(accepts, self.start_timeout)

    def clients(self, dbname: str) -> list[dict[str, Any]]:
        """The client connections PgBouncer holds for ``dbname`` (its ``SHOW CLIENTS``)."""
        with psycopg.connect(
            f"host=127.0.0.1 port={self._port} dbname=pgbouncer user=postgres",
            autocommit=True,
            connect_timeout=2,
        ) as conn:
            cursor = conn.execute("SHOW CLIENTS")
            names = [column.name for column in cursor.description or ()]
            rows = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
        return [row for row in rows if row.get("database") == dbname]

    def _mode(self) -> str | None:
        with psycopg.connect(
            f"host=127.0.0.1 port={self._port} dbname=pgbouncer user=postgres",
            autocommit=True,
            connect_timeout=2,
        ) as conn:
            for row in conn.execute("SHOW CONFIG").fetchall():
                if row[0] == "pool_mode":
                    return str(row[1])
        return None

    def stop(self) -> None:
        """SIGINT (safe shutdown: wait for the transactions in flight), SIGKILL after 10 s."""
        self._shutdown(signal.SIGINT, 10)
        procs.remove_tree(self._tmp)
        self._tmp = None


class RedisServer(_ServerBase):
    """A throwaway redis-server on 127.0.0.1:port; without persistence unless asked for.

    ``persistent=True`` turns on the append-only file with fsync on every write, as a
    production broker that must keep durable queues across a restart would run.
    """

    name = "redis"

    def __init__(
        self,
        port: int | None = None,
        start_timeout: float = 30,
        persistent: bool = False,
        password: str | None = None,
    ) -> None:
        super().__init__(port)
        self.start_timeout = start_timeout
        self.persistent = persistent
        #: With a password the server runs with ``requirepass`` and its URLs carry it.
        self.password = password

    @property
    def url(self) -> str:
        return self.url_for(0)

    def url_for(self, db: int) -> str:
        auth = "" if self.password is None else f":{quote(self.password, safe='')}@"
        return f"redis://{auth}127.0.0.1:{self._port}/{db}"

    def client(self, db: int = 0) -> redis.Redis:
        """A new redis-py client; the caller must close it (``with server.client() as r``)."""
        return redis.Redis(
            host="127.0.0.1",
            port=self._port,
            db=db,
            password=self.password,
            socket_connect_timeout=2,
        )

    def start(self) -> None:
        if self._proc is not None:
            return
        if self._tmp is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="rig-redis-"))
        argv = [REDIS_SERVER, "--port", str(self._port), "--bind", "127.0.0.1"]
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.persistent else []
        argv += ["--save", "", "--appendonly", "no", *persistence, "--dir", str(self._tmp)]
        argv += ["--daemonize", "no", "--protected-mode", "no"]
        if self.password is not None:
            argv += ["--requirepass", self.password]
        self._spawn(argv, cwd=self._tmp)

        def pings() -> bool:
            # Check the PID so we never mistake another server on the port for ours.
            try:
                with self.client() as r:
                    info = r.info("server")
            except redis.ConnectionError:
                return False
            return bool(info.get("process_id") == self.pid)

        self._wait_ready(pings, self.start_timeout)

    def stop(self, keep_dir: bool = False) -> None:
        """SIGTERM, SIGKILL after 15 s; removes the temp dir unless ``keep_dir``."""
        self._shutdown(signal.SIGTERM, 15)
        if not keep_dir:
            procs.remove_tree(self._tmp)
            self._tmp = None

    def restart(self) -> None:
        """Stop and start on the same port; data is lost (no persistence), clients reconnect."""
        self.stop(keep_dir=True)
        self.start()

    def flushall(self) -> None:
        with self.client() as r:
            r.flushall()


RABBITMQ_BIN = Path("/usr/lib/rabbitmq/bin")
EPMD = "/usr/bin/epmd"


class RabbitMQServer(_ServerBase):
    """A throwaway RabbitMQ node (Debian's ``rabbitmq-server``) on 127.0.0.1, as the test user.

    Everything lives in a temp dir (HOME with its Erlang cookie, mnesia, logs, no plugins) and
    the node has a unique name. Erlang's port mapper is ours too: an ``epmd`` on a free port,
    started before the node (which would otherwise daemonize a shared one on 4369) and stopped
    by PID after it. Startup is bounded and confirmed with ``rabbitmqctl await_startup``.
    """

    name = "rabbitmq"

    def __init__(self, port: int | None = None, start_timeout: float = 90) -> None:
        super().__init__(port)
        self.start_timeout = start_timeout
        self.dist_port = free_port()
        self.epmd_port = free_port()
        self.node = f"rig-{uuid.uuid4().hex[:8]}@localhost"
        self._epmd: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The broker URL (the default vhost; ``guest`` may log in from loopback)."""
        return f"amqp://guest:guest@127.0.0.1:{self._port}//"

    def _env(self) -> dict[str, str]:
        assert self._tmp is not None
        tmp = self._tmp
        return _clean_env(
            HOME=str(tmp),
            ERL_EPMD_PORT=str(self.epmd_port),
            ERL_EPMD_ADDRESS="127.0.0.1",
            RABBITMQ_NODENAME=self.node,
            RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
            RABBITMQ_NODE_PORT=str(self._port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_MNESIA_BASE=str(tmp / "mnesia"),
            RABBITMQ_LOG_BASE=str(tmp / "log"),
            RABBITMQ_PID_FILE=str(tmp / "rabbitmq.pid"),
            RABBITMQ_CONF_ENV_FILE=str(tmp / "rabbitmq-env.conf"),
            RABBITMQ_CONFIG_FILE=str(tmp / "rabbitmq"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(tmp / "enabled_plugins"),
            RABBITMQ_ALLOW_INPUT="",
        )

    def ctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run ``rabbitmqctl -n <node> ARGS`` against this node."""
        return subprocess.run(
            [str(RABBITMQ_BIN / "rabbitmqctl"), "-n", self.node, *args],
            env=self._env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def start(self) -> None:
        if self._proc is not None:
            return
        self._tmp = Path(tempfile.mkdtemp(prefix="rig-rabbitmq-"))
        procs.register(self)  # so the temp dir (and epmd) go even if the start fails
        (self._tmp / "rabbitmq-env.conf").write_text("")
        (self._tmp / "enabled_plugins").write_text("[].\n")
        (self._tmp / "rabbitmq.conf").write_text("loopback_users.guest = true\n")
        with open(self._tmp / "epmd.log", "ab") as log:
            self._epmd = subprocess.Popen(
                [EPMD, "-port", str(self.epmd_port), "-address", "127.0.0.1"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self._env(),
            )
        self._spawn([str(RABBITMQ_BIN / "rabbitmq-server")], cwd=self._tmp, env=self._env())
        deadline = time.monotonic() + self.start_timeout

        def booted() -> bool:
            # await_startup answers at once (non-zero) while the node is not registered yet.
            left = max(1, int(deadline - time.monotonic()))
            return (
                self.ctl("await_startup", "--timeout", str(left), timeout=left + 30).returncode == 0
            )

        def accepts() -> bool:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self._port), timeout=2),
            ):
                return True
            return False

        self._wait_ready(lambda: booted() and accepts(), self.start_timeout)

    def _stop_epmd(self) -> None:
        if self._epmd is not None:
            procs.terminate_tree(self._epmd, signal.SIGTERM, 5)
            self._epmd = None

    def stop(self) -> None:
        """SIGTERM the Erlang VM (a clean shutdown), SIGKILL after 30 s; then epmd; rm the dir."""
        if self._proc is not None and self._tmp is not None:
            # The Popen child is the start script's shell; the VM's PID is in the pid file.
            with contextlib.suppress(OSError, ValueError):
                beam = int((self._tmp / "rabbitmq.pid").read_text().strip())
                if beam in procs.descendants(self._proc.pid):
                    os.kill(beam, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(30)
        self._shutdown(signal.SIGTERM, 10)
        self._stop_epmd()
        procs.remove_tree(self._tmp)
        self._tmp = None

    def emergency_kill(self) -> None:
        procs.kill_tree_now(self._proc)
        self._proc = None
        procs.kill_tree_now(self._epmd)
        self._epmd = None
        procs.remove_tree(self._tmp)
        self._tmp = None
