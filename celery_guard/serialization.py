"""JSON for results, fingerprints and stored messages, through kombu's encoder.

kombu's encoder round-trips what Celery's JSON serializer does (datetimes, UUIDs, decimals), so a
result returned from the store reads the same as one the body returned through the result backend.
"""

from __future__ import annotations

from typing import Any

from kombu.utils.json import dumps as _kombu_dumps
from kombu.utils.json import loads as _kombu_loads


def dumps(value: Any, *, canonical: bool = False) -> str:
    """JSON text; ``canonical`` sorts keys and drops spaces so equal values give equal text."""
    if canonical:
        return str(
            _kombu_dumps(  # type: ignore[no-untyped-call]
                value, sort_keys=True, separators=(",", ":"), ensure_ascii=False
            )
        )
    return str(_kombu_dumps(value))  # type: ignore[no-untyped-call]


def loads(text: str) -> Any:
    """Parse JSON text written by :func:`dumps`."""
    return _kombu_loads(text)  # type: ignore[no-untyped-call]
