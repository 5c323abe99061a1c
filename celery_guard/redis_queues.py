"""Reading kombu's Redis queues without taking anything: depth, oldest publish time, a scan.

kombu's Redis transport keeps a queue in one Redis list per priority step (the queue's name,
then ``name + SEP + step``; kombu/transport/redis.py ``_q_for_pri``), LPUSHes new messages and
BRPOPs, so each list's oldest message is its last element. The sampler and the reaper's
publish tracking read through a kombu channel (:func:`channel_lists`, whose client adds
``global_keyprefix`` itself); ``guard reconcile`` reads with a Redis client of its own
(:func:`configured_lists`). Everything else here works on a client and a list of names.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any, Final

from celery_guard.messages import PUBLISHED_AT_HEADER

#: kombu's Redis transport keeps priority ``p`` of queue ``q`` in the list ``q + SEP + p``.
KOMBU_PRIORITY_SEP: Final = "\x06\x16"
#: kombu's default ``priority_steps`` transport option.
KOMBU_PRIORITY_STEPS: Final = (0, 3, 6, 9)


def channel_lists(channel: Any, queue: str) -> list[str] | None:
    """The Redis lists behind a queue, one per priority, as a kombu channel names them;
    ``None`` if the channel is not Redis's."""
    q_for_pri = getattr(channel, "_q_for_pri", None)
    steps = getattr(channel, "priority_steps", None)
    if q_for_pri is None or steps is None:
        return None
    return [q_for_pri(queue, priority) for priority in steps]


def configured_lists(queue: str, transport_options: Mapping[str, Any]) -> list[str]:
    """The Redis lists behind a queue for a plain Redis client: prefixed with the transport's
    ``global_keyprefix`` (kombu's own client adds it), one per ``priority_steps`` step."""
    prefix = str(transport_options.get("global_keyprefix") or "")
    steps = transport_options.get("priority_steps") or KOMBU_PRIORITY_STEPS
    return [prefix + queue] + [
        f"{prefix}{queue}{KOMBU_PRIORITY_SEP}{step}" for step in steps if step
    ]


def depth(client: Any, lists: list[str]) -> int:
    """Messages waiting in the lists together: one pipelined round trip (kombu's ``_size``)."""
    with client.pipeline(transaction=False) as pipe:
        for name in lists:
            pipe.llen(name)
        return sum(int(size) for size in pipe.execute())


def oldest_stamps(client: Any, lists: list[str]) -> list[float | None]:
    """The publish-time header of each non-empty list's oldest message (``None`` for a message
    without one), read with LINDEX -1."""
    stamps: list[float | None] = []
    for name in lists:
        raw = client.lindex(name, -1)
        if raw is None:
            continue
        try:
            headers = json.loads(raw).get("headers") or {}
            stamps.append(float(headers[PUBLISHED_AT_HEADER]))
        except (ValueError, KeyError, TypeError, AttributeError):
            stamps.append(None)
    return stamps


def scan(client: Any, lists: list[str], *, limit: int, page: int) -> Iterator[tuple[str, bytes]]:
    """(list, raw message) for up to ``limit`` messages, read ``page`` at a time with LRANGE."""
    seen = 0
    for name in lists:
        start = 0
        while True:
            chunk: list[bytes] = list(client.lrange(name, start, start + page - 1))
            for raw in chunk:
                if seen >= limit:
                    return
                seen += 1
                yield name, raw
            if len(chunk) < page:
                break
            start += page
