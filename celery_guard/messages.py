"""The stored task message: what the store keeps to send a task again, built and re-sent here.

A stored message is canonical JSON of the task's name, id, arguments, key headers and routing
(plus, for a task inside a canvas, its ``workflow``: callbacks, the rest of a chain, a chord,
its group), enough for :func:`republish` to send the task again as it was sent. It is built
from four places, one function each:

- :func:`from_request`: a delivery claiming its key (stored with the claim; the reaper
  re-publishes it when the owner dies);
- :func:`from_undeliverable_request`: a delivery with no usable key, kept as a dead letter;
- :func:`from_publish`: a tracked publish (``guard_track_publishes``), recorded before it
  leaves the producer;
- :func:`from_kombu_message`: the raw message of a task the worker does not know, kept as a
  dead letter.

:func:`republish` sends a stored message again; publishes inside it are never tracked again
(the store knows their key already) and carry the publish time it was given.
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

from celery_guard import serialization
from celery_guard.keys import (
    HEADER_KEY,
    HEADER_KEY_SOURCE,
    KeySource,
    Payload,
    canonical_json,
)
from celery_guard.serialization import json_string

#: The header every message carries from publish (stamped by celery_guard's publish hook):
#: epoch seconds; queue lag, a queue's oldest-waiting age and publish tracking read it.
PUBLISHED_AT_HEADER: Final = "guard_published_at"

#: Where a task's place in a workflow is, by ``send_task`` option: the field of Celery's
#: request (and of a published message: its body's ``embed`` for the first four, its headers
#: for the group's two; celery/app/amqp.py ``as_task_v2``).
WORKFLOW_FIELDS: Final = (
    ("link", "callbacks"),
    ("link_error", "errbacks"),
    ("chain", "chain"),
    ("chord", "chord"),
    ("group_id", "group"),
    ("group_index", "group_index"),
)
#: A request's workflow fields at once, and what they are outside any canvas.
_WORKFLOW_PROBES: Final = operator.attrgetter(*(name for _option, name in WORKFLOW_FIELDS))
_NO_WORKFLOW: Final = (None,) * len(WORKFLOW_FIELDS)
#: The workflow fields a published message carries in its body's ``embed`` (the rest are
#: headers).
_EMBEDDED: Final = frozenset({"callbacks", "errbacks", "chain", "chord"})


def storable_json(value: Any) -> str | None:
    """Canonical JSON of ``value`` if every database can store it, else ``None``."""
    try:
        text = serialization.dumps(value, canonical=True)
        text.encode("utf-8")  # lone surrogates pass json.dumps, no database takes them
    except (TypeError, ValueError):
        return None
    return text


def _message(
    task_name: str,
    task_id: Any,
    args: Any,
    kwargs: Any,
    headers: dict[str, Any],
    exchange: Any,
    routing_key: Any,
    priority: Any,
) -> dict[str, Any]:
    return {
        "args": list(args or ()),
        "kwargs": dict(kwargs or {}),
        **_envelope(task_name, task_id, headers, exchange, routing_key, priority),
    }


def _envelope(
    task_name: str,
    task_id: Any,
    headers: dict[str, Any],
    exchange: Any,
    routing_key: Any,
    priority: Any,
) -> dict[str, Any]:
    """A stored message but for its arguments."""
    return {
        "task": task_name,
        "id": task_id,
        "headers": headers,
        "exchange": exchange,
        "routing_key": routing_key,
        "priority": priority,
    }


def _workflow(read: Any) -> dict[str, Any]:
    """The ``workflow`` of a message whose workflow fields ``read(field)`` returns.

    Empty for a task outside any canvas, whose stored message then has none.
    """
    workflow = {}
    for option, name in WORKFLOW_FIELDS:
        value = read(name)
        if value is not None and value != []:
            workflow[option] = value
    if workflow:
        # Keep the recovered task's place in the canvas's result graph too.
        workflow.update(root_id=read("root_id"), parent_id=read("parent_id"))
    return workflow


def _with_workflow(message: dict[str, Any], workflow: dict[str, Any]) -> str:
    """Canonical JSON of ``message`` with its workflow; raises when the message is not JSON."""
    if workflow:
        try:
            return canonical_json({**message, "workflow": workflow})
        except (TypeError, ValueError):
            # A callback with arguments JSON cannot hold: re-published without its workflow
            # (the original message, which has it, still returns after the visibility timeout).
            pass
    return canonical_json(message)


def from_request(
    task_name: str, request: Any, payload: Payload, key: str, source: KeySource
) -> str:
    """What re-publishing a delivery needs, stored with its claim (raises if not JSON).

    The arguments go in as ``payload`` serialized them (once per delivery, with the
    fingerprint): the text is what :func:`canonical_json` gives for the whole message, its
    keys in sorted order, ``args`` and ``kwargs`` spliced in between the other fields.
    """
    delivery_info = request.delivery_info or {}
    exchange = delivery_info.get("exchange")
    priority = delivery_info.get("priority")
    routing_key = delivery_info.get("routing_key")
    task_id = request.id
    workflow = {}
    try:
        probes = _WORKFLOW_PROBES(request)  # one C call where six getattr() were Python's
    except AttributeError:  # a request without Celery's Context defaults
        probes = tuple(getattr(request, name, None) for _option, name in WORKFLOW_FIELDS)
    if probes != _NO_WORKFLOW and any(value is not None and value != [] for value in probes):
        workflow = _workflow(lambda field: getattr(request, field, None))
    if not workflow and type(task_id) is str:
        # A message outside any canvas: written as the encoder would (sorted keys, no spaces),
        # without its per-call setup (a tenth of a no-op task's own Python calls). The fields
        # every delivery of a task from one queue shares are written once per process.
        envelope = _envelope_texts(exchange, priority, routing_key, task_name)
        if envelope is not None:
            exchange_text, tail_text = envelope
            return (
                f'{{"args":{payload.args_json},"exchange":{exchange_text},'
                f'"headers":{{{_HEADER_KEY_TEXT}:{json_string(key)},'
                f"{_HEADER_SOURCE_TEXT}:{_SOURCE_TEXTS[source]}}},"
                f'"id":{json_string(task_id)},"kwargs":{payload.kwargs_json},{tail_text}}}'
            )
    before_kwargs = {  # sorted between "args" and "kwargs"
        "exchange": exchange,
        "headers": {HEADER_KEY: key, HEADER_KEY_SOURCE: source.value},
        "id": task_id,
    }
    after_kwargs: dict[str, Any] = {
        "priority": priority,
        "routing_key": routing_key,
        "task": task_name,
    }
    head = f'{{"args":{payload.args_json},{canonical_json(before_kwargs)[1:-1]},"kwargs":'
    if workflow:
        try:
            tail = canonical_json({**after_kwargs, "workflow": workflow})
        except (TypeError, ValueError):
            pass  # as in _with_workflow: re-published without it
        else:
            return f"{head}{payload.kwargs_json},{tail[1:]}"
    return f"{head}{payload.kwargs_json},{canonical_json(after_kwargs)[1:]}"


#: The header names as canonical JSON writes them (HEADER_KEY sorts before HEADER_KEY_SOURCE).
_HEADER_KEY_TEXT: Final = json_string(HEADER_KEY)
_HEADER_SOURCE_TEXT: Final = json_string(HEADER_KEY_SOURCE)
_SOURCE_TEXTS: Final = {source: json_string(source.value) for source in KeySource}


#: Canonical texts of the envelope fields by (exchange, priority, routing key, task name), each
#: with its type (``True == 1 == 1.0`` as keys, not as JSON): a worker sees a few of these,
#: each for many deliveries (bounded: emptied when it grows past _ENVELOPES_KEPT). ``None``: a
#: field that is not a plain scalar.
_envelopes: dict[tuple[Any, ...], tuple[str, str] | None] = {}
_ENVELOPES_KEPT: Final = 256


def _envelope_texts(
    exchange: Any, priority: Any, routing_key: Any, task_name: str
) -> tuple[str, str] | None:
    """The exchange's text and that of the message's last three fields (priority, routing key,
    task), as canonical JSON writes them; ``None`` when one is not a string, int or ``None``."""
    fields: tuple[Any, ...] = (
        exchange,
        type(exchange),
        priority,
        type(priority),
        routing_key,
        type(routing_key),
        task_name,
    )
    try:
        return _envelopes[fields]
    except KeyError:
        pass
    except TypeError:  # an unhashable field: not a scalar either
        return None
    texts = _scalars(exchange, priority, routing_key, task_name)
    envelope = None
    if texts is not None:
        exchange_text, priority_text, routing_key_text, task_text = texts
        envelope = (
            exchange_text,
            f'"priority":{priority_text},"routing_key":{routing_key_text},"task":{task_text}',
        )
    if len(_envelopes) >= _ENVELOPES_KEPT:
        _envelopes.clear()
    _envelopes[fields] = envelope
    return envelope


def _scalars(*values: Any) -> list[str] | None:
    """Each value as canonical JSON writes it, when all are strings, ints or ``None``."""
    texts = []
    for value in values:
        kind = type(value)
        if kind is str:
            texts.append(json_string(value))
        elif value is None:
            texts.append("null")
        elif kind is int:
            texts.append(int.__repr__(value))
        else:
            return None
    return texts


def from_undeliverable_request(task_name: str, request: Any, args: Any, kwargs: Any) -> str | None:
    """A delivery with no usable key, as its dead letter keeps it (``None`` if not JSON).

    Its key headers go along as they came, so a replay after the producer is fixed meets the
    same checks; no workflow, as no key ever ran.
    """
    headers = request.headers or {}
    delivery_info = request.delivery_info or {}
    return storable_json(
        _message(
            task_name,
            request.id,
            args,
            kwargs,
            {
                name: value
                for name in (HEADER_KEY, HEADER_KEY_SOURCE)
                if (value := headers.get(name, getattr(request, name, None))) is not None
            },
            delivery_info.get("exchange"),
            delivery_info.get("routing_key"),
            delivery_info.get("priority"),
        )
    )


def from_publish(
    task_name: str,
    task_id: str,
    args: Any,
    kwargs: Any,
    embed: dict[str, Any],
    headers: dict[str, Any],
    *,
    key: str,
    source: KeySource,
    exchange: Any,
    routing_key: str | None,
    properties: dict[str, Any],
) -> str | None:
    """A publish as ``before_task_publish`` sees it (task protocol 2), or ``None`` if not JSON."""
    message = _message(
        task_name,
        task_id,
        args,
        kwargs,
        {HEADER_KEY: key, HEADER_KEY_SOURCE: source.value},
        getattr(exchange, "name", exchange),
        routing_key,
        (properties or {}).get("priority"),
    )
    if headers.get("expires"):
        message["expires"] = headers["expires"]
    workflow = _workflow(
        lambda name: (embed if name in _EMBEDDED else headers).get(name),
    )
    try:
        return _with_workflow(message, workflow)
    except (TypeError, ValueError):
        return None


def from_kombu_message(task_name: str, task_id: str, raw: Any) -> str | None:
    """The stored message of a raw kombu message (task protocol 2 or 1), or ``None``."""
    try:
        body = raw.decode()
        headers = dict(raw.headers or {})
        delivery = dict(raw.delivery_info or {})
    except Exception:
        return None
    if isinstance(body, (list, tuple)) and len(body) >= 2:
        args, kwargs = body[0], body[1]
    elif isinstance(body, dict):
        args, kwargs = body.get("args"), body.get("kwargs")
    else:
        return None
    return storable_json(
        _message(
            task_name,
            task_id,
            args,
            kwargs,
            {k: headers[k] for k in (HEADER_KEY, HEADER_KEY_SOURCE) if headers.get(k) is not None},
            delivery.get("exchange"),
            delivery.get("routing_key"),
            delivery.get("priority"),
        )
    )


# -- sending a stored message again ---------------------------------------------------------------


@dataclass(frozen=True)
class _Republishing:
    #: The ``guard_published_at`` value to stamp instead of the clock.
    stamp: float | None


_REPUBLISHING: contextvars.ContextVar[_Republishing | None] = contextvars.ContextVar(
    "celery_guard_republishing", default=None
)


@contextlib.contextmanager
def _republishing(stamp: float | None) -> Iterator[None]:
    outer = _REPUBLISHING.get()
    if stamp is None and outer is not None:
        stamp = outer.stamp
    token = _REPUBLISHING.set(_Republishing(stamp))
    try:
        yield
    finally:
        _REPUBLISHING.reset(token)


def republishing() -> bool:
    """Whether this publish is :func:`republish`'s (publish tracking leaves it alone)."""
    return _REPUBLISHING.get() is not None


def preset_stamp() -> float | None:
    """The publish time :func:`republish` was given, if any (read by the stamping hook)."""
    context = _REPUBLISHING.get()
    return None if context is None else context.stamp


def republish(app: Any, message: dict[str, Any], *, published_at: float | None = None) -> None:
    """Send the task of a stored message again: same name, arguments, headers, id and routing.

    The stored ``workflow`` (link, link_error, chain, chord, group and parent ids) goes along,
    so a recovered or replayed task still hands its result on to the rest of its canvas.
    ``published_at`` is stamped as its publish time instead of the clock (the reaper records
    it before sending). The store knows the key already (its row, or a tracked publish), so
    the publish is never recorded again.
    """
    options: dict[str, Any] = {"headers": message.get("headers") or {}}
    options.update(message.get("workflow") or {})
    exchange, routing_key = message.get("exchange"), message.get("routing_key")
    if not exchange and routing_key:
        # Sent to the default exchange: the routing key is the queue (as Celery's retry does).
        options["queue"] = routing_key
    elif exchange:
        options["exchange"] = exchange
        options["routing_key"] = routing_key
    if message.get("priority") is not None:
        options["priority"] = message["priority"]
    if message.get("expires"):
        options["expires"] = message["expires"]
    with _republishing(published_at):
        app.send_task(
            message["task"],
            args=message.get("args") or [],
            kwargs=message.get("kwargs") or {},
            task_id=message.get("id"),
            **options,
        )
