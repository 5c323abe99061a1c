"""A pretend payment provider on 127.0.0.1, and the shop's client for it.

The provider stands for any system outside the store's database that a task changes: a card
processor, a warehouse API, another team's service. Its rules are the two that make such a
system safe to call from tasks that may run more than once:

* **Idempotency key** (``Idempotency-Key`` header, as card processors offer): a request repeating
  a key that already charged gets the *first* charge back and charges nothing. A task that was
  taken over after its worker died between the provider's reply and the shop's commit repeats
  its request; this is what keeps the customer from paying twice.
* **Fencing token** (``Fencing-Token`` header): per key, the provider remembers the highest
  token it has seen and refuses (HTTP 409) a request with a lower one. celery_guard's token rises
  with every new owner of a key, so a worker that froze past its lease and woke up cannot
  charge, or change anything, after a newer owner has spoken.

It can also fail on purpose: ``--failure-rate 0.15`` answers 15% of charges with HTTP 503 before
doing anything, as a busy provider does. Requests without the headers (plain Celery has no
fencing token) are charged every time, as most payment APIs do.

Run it with ``python -m example_project.payment_provider --port 8099``. ``GET /ledger`` returns
every charge and every refusal, which is what the demo audits.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# -- the client the shop's tasks use ------------------------------------------------------------


class ProviderError(Exception):
    """The provider answered with an HTTP error.

    ``status_code`` is what celery_guard's failure policy reads: 5xx and 429 are transient
    (retried with full-jitter backoff), other 4xx permanent (dead-lettered at once).
    """

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(status_code, message)
        self.status_code = status_code
        self.message = message

    def __str__(self) -> str:
        return f"payment provider answered {self.status_code}: {self.message}"


class ProviderUnavailable(ProviderError):
    """HTTP 5xx: the provider is busy or down; nothing was charged. Try again later."""


class StaleFencingToken(ProviderError):
    """HTTP 409: the provider has seen a newer owner of this idempotency key."""


class PaymentProvider:
    """A small client for the provider's ``POST /charges``."""

    def __init__(self, url: str, timeout: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def charge(
        self,
        order_id: int,
        amount_cents: int,
        *,
        idempotency_key: str | None = None,
        fencing_token: int | None = None,
        client: str | None = None,
    ) -> dict[str, Any]:
        """Charge an order; return the provider's charge (``{"id": "ch_...", ...}``).

        Raises :class:`ProviderUnavailable` (5xx), :class:`StaleFencingToken` (409), another
        :class:`ProviderError`, or ``ConnectionError`` / ``TimeoutError`` when it cannot be
        reached (both transient for celery_guard).
        """
        headers = {"Content-Type": "application/json", "User-Agent": f"shop/{client or '?'}"}
        if idempotency_key is not None:
            headers["Idempotency-Key"] = idempotency_key
        if fencing_token is not None:
            headers["Fencing-Token"] = str(fencing_token)
        body = json.dumps({"order_id": order_id, "amount_cents": amount_cents}).encode()
        request = urllib.request.Request(
            f"{self.url}/charges", data=body, headers=headers, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return dict(json.loads(response.read()))
        except urllib.error.HTTPError as exc:
            message = exc.read().decode(errors="replace")
            if exc.code == 409:
                raise StaleFencingToken(exc.code, message) from None
            if exc.code >= 500:
                raise ProviderUnavailable(exc.code, message) from None
            raise ProviderError(exc.code, message) from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                raise TimeoutError(f"payment provider timed out: {exc.reason}") from None
            raise ConnectionError(f"payment provider unreachable: {exc.reason}") from None


# -- the provider itself ------------------------------------------------------------------------


class Ledger:
    """The provider's state: charges, highest fencing token per key, and an event log."""

    def __init__(self, failure_rate: float, latency: tuple[float, float], seed: int) -> None:
        self.failure_rate = failure_rate
        self.latency = latency
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.charges: list[dict[str, Any]] = []
        self.by_key: dict[str, dict[str, Any]] = {}
        self.highest_token: dict[str, int] = {}
        #: (time, outcome, order id, client): charged, replayed, refused_stale, unavailable.
        self.events: list[tuple[float, str, int, str]] = []
        #: Requests being handled now: request number -> (client, order id).
        self.in_flight: dict[int, tuple[str, int]] = {}

    def pause(self) -> float:
        with self._lock:
            return self._random.uniform(*self.latency)

    def should_fail(self) -> bool:
        with self._lock:
            return self._random.random() < self.failure_rate

    def charge(
        self, order_id: int, amount_cents: int, key: str | None, token: int | None, client: str
    ) -> tuple[int, dict[str, Any]]:
        """Apply the fencing and idempotency rules; return (HTTP status, response body)."""
        with self._lock:
            now = time.time()
            if key is not None and token is not None:
                highest = self.highest_token.get(key, 0)
                if token < highest:
                    self.events.append((now, "refused_stale", order_id, client))
                    return 409, {
                        "error": "stale fencing token",
                        "fencing_token": token,
                        "highest_seen": highest,
                    }
                self.highest_token[key] = token
            if key is not None and key in self.by_key:
                self.events.append((now, "replayed", order_id, client))
                return 200, {**self.by_key[key], "replayed": True}
            charge = {
                "id": f"ch_{next(self._ids):06d}",
                "order_id": order_id,
                "amount_cents": amount_cents,
                "idempotency_key": key,
                "fencing_token": token,
                "client": client,
                "created_at": now,
            }
            self.charges.append(charge)
            if key is not None:
                self.by_key[key] = charge
            self.events.append((now, "charged", order_id, client))
            return 201, charge

    def unavailable(self, order_id: int, client: str) -> None:
        with self._lock:
            self.events.append((time.time(), "unavailable", order_id, client))

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"charges": list(self.charges), "events": list(self.events)}


class _Handler(BaseHTTPRequestHandler):
    server: _ProviderServer
    _requests = itertools.count(1)

    def do_POST(self) -> None:
        if self.path != "/charges":
            self._reply(404, {"error": "not found"})
            return
        ledger = self.server.ledger
        try:
            length = int(self.headers.get("Content-Length") or 0)
            payload = json.loads(self.rfile.read(length))
            order_id, amount = int(payload["order_id"]), int(payload["amount_cents"])
            key = self.headers.get("Idempotency-Key")
            token_text = self.headers.get("Fencing-Token")
            token = int(token_text) if token_text is not None else None
        except (ValueError, KeyError, TypeError) as exc:
            self._reply(400, {"error": f"bad request: {exc}"})
            return
        client = (self.headers.get("User-Agent") or "?").removeprefix("shop/")
        number = next(self._requests)
        ledger.in_flight[number] = (client, order_id)
        try:
            # The provider takes a while to answer; a worker killed meanwhile never hears back,
            # although the charge below still happens.
            time.sleep(ledger.pause())
            if ledger.should_fail():
                ledger.unavailable(order_id, client)
                self._reply(503, {"error": "temporarily unavailable, try again later"})
                return
            status, body = ledger.charge(order_id, amount, key, token, client)
            self._reply(status, body)
        finally:
            ledger.in_flight.pop(number, None)

    def do_GET(self) -> None:
        ledger = self.server.ledger
        if self.path == "/health":
            self._reply(200, {"ok": True})
        elif self.path == "/ledger":
            self._reply(200, ledger.snapshot())
        elif self.path == "/inflight":
            self._reply(200, {"requests": list(ledger.in_flight.values())})
        else:
            self._reply(404, {"error": "not found"})

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the caller died (SIGKILLed worker); what was charged stays charged

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: the ledger is the log


class _ProviderServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], ledger: Ledger) -> None:
        super().__init__(address, _Handler)
        self.ledger = ledger


def main() -> None:
    parser = argparse.ArgumentParser(description="A pretend payment provider on 127.0.0.1.")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--failure-rate", type=float, default=0.0, help="share of HTTP 503s")
    parser.add_argument(
        "--latency", type=float, nargs=2, default=(0.1, 0.3), metavar=("MIN", "MAX")
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    ledger = Ledger(args.failure_rate, (args.latency[0], args.latency[1]), args.seed)
    server = _ProviderServer(("127.0.0.1", args.port), ledger)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
