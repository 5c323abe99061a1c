"""JSON for results, fingerprints and stored messages, through kombu's encoder.

kombu's encoder round-trips what Celery's JSON serializer does (datetimes, UUIDs, decimals), so a
result returned from the store reads the same as one the body returned through the result backend.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any, Final

from celery.result import ResultBase, result_from_tuple
from kombu import serialization as kombu_serialization
from kombu.exceptions import EncodeError
from kombu.utils.json import JSONEncoder
from kombu.utils.json import dumps as _kombu_dumps
from kombu.utils.json import loads as _kombu_loads

#: kombu's encoder with the canonical options, built once: ``json.dumps`` would build one per
#: call, and the hot path encodes every argument of every delivery.
_CANONICAL = JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def dumps(value: Any, *, canonical: bool = False) -> str:
    """JSON text; ``canonical`` sorts keys and drops spaces so equal values give equal text.

    Canonical text composes: a container's text is its items' texts joined as JSON joins
    them (what :func:`celery_guard.keys.encode_payload` relies on to serialize once).
    """
    if canonical:
        return str(_CANONICAL.encode(value))
    return str(_kombu_dumps(value))  # type: ignore[no-untyped-call]


#: ``text`` as a JSON string, exactly as :func:`dumps` writes it (canonical or not): the
#: string encoder json uses without ensure_ascii (its C version where there is one), for strings
#: inside a container and alone alike, since kombu's encoder only adds a ``default``. Bound,
#: not wrapped: a delivery calls it for each field of its stored message (messages.py).
json_string: Final[Callable[[str], str]] = json.encoder.encode_basestring


def loads(text: str) -> Any:
    """Parse JSON text written by :func:`dumps`."""
    return _kombu_loads(text)  # type: ignore[no-untyped-call]


#: The key of an envelope: a stored result that is not the body's value as plain JSON.
ENVELOPE = "__celery_guard__"


class ResultCodec:
    """A task's result as the store keeps it (JSON text), prepared as Celery's backend does.

    Celery's result backend stores an ``AsyncResult``/``GroupResult`` a task returns as its
    ``as_tuple()`` (``celery/backends/base.py``, ``prepare_value``) unless its serializer is
    pickle, and encodes everything with the app's ``result_serializer``. So that a task
    accepted by the backend is accepted here, and a duplicate answers what the body returned:

    - with the JSON serializer (Celery's default) a result is stored as plain JSON, an
      ``AsyncResult``/``GroupResult`` as an envelope holding its tuple, restored with Celery's
      ``result_from_tuple`` for a duplicate;
    - with any other serializer (pickle, msgpack, yaml) the value is encoded by it and kept in
      an envelope (base64 for binary content), decoded with the app's accepted content types.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        conf = app.conf
        self.serializer: str = conf.result_serializer
        # Names ("pickle") to content types, as Celery's backend does.
        self.accept = kombu_serialization.prepare_accept_content(  # type: ignore[no-untyped-call]
            conf.result_accept_content or conf.accept_content
        )

    def dumps(self, value: Any) -> str:
        """JSON text for ``value``; ``TypeError`` when the backend's serializer refuses it."""
        if value is None and self.serializer == "json":
            return "null"  # what most bodies return, without a trip through the encoder
        if self.serializer != "pickle" and isinstance(value, ResultBase):
            return dumps({ENVELOPE: "celery.result", "value": value.as_tuple()})
        if self.serializer == "json":
            if isinstance(value, dict) and ENVELOPE in value:
                # A body's own dict that looks like an envelope is wrapped, never misread.
                return dumps({ENVELOPE: "json", "value": value})
            return dumps(value)
        try:
            content_type, encoding, data = kombu_serialization.dumps(  # type: ignore[no-untyped-call]
                value, serializer=self.serializer
            )
        except EncodeError as exc:
            raise TypeError(str(exc)) from exc
        binary = isinstance(data, bytes)
        return dumps(
            {
                ENVELOPE: "serialized",
                "content_type": content_type,
                "content_encoding": encoding,
                "base64": binary,
                "data": base64.b64encode(data).decode("ascii") if binary else data,
            }
        )

    def loads(self, text: str) -> Any:
        """The value :meth:`dumps` stored (an envelope restored), or a plain JSON result."""
        value = loads(text)
        if not (isinstance(value, dict) and ENVELOPE in value):
            return value
        kind = value[ENVELOPE]
        if kind == "celery.result":
            return result_from_tuple(value["value"], self.app)
        if kind == "serialized":
            data = value["data"]
            return kombu_serialization.loads(  # type: ignore[no-untyped-call]
                base64.b64decode(data) if value.get("base64") else data,
                value["content_type"],
                value["content_encoding"],
                accept=self.accept,
            )
        return value["value"]
