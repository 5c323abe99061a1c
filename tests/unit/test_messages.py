"""The stored message of a delivery, built with its arguments serialized once."""

from __future__ import annotations

import types

import pytest
from celery.app.task import Context
from hypothesis import given
from hypothesis import strategies as st

from celery_guard import messages, serialization
from celery_guard.keys import (
    HEADER_KEY,
    HEADER_KEY_SOURCE,
    KeySource,
    canonical_json,
    encode_payload,
)


def body(order_id: object, *lines: object, **options: object) -> None:
    """A task body's signature."""


def request(**fields: object) -> types.SimpleNamespace:
    base: dict[str, object] = {
        "id": "task-1",
        "delivery_info": {"exchange": "", "routing_key": "orders", "priority": 3},
    }
    return types.SimpleNamespace(**{**base, **fields})


def whole(
    req: types.SimpleNamespace,
    args: list[object],
    kwargs: dict[str, object],
    key: str = "order:1",
    task: str = "shop.order",
) -> str:
    """The message as one canonical JSON pass over the whole dict writes it."""
    message: dict[str, object] = {
        "task": task,
        "id": req.id,
        "args": args,
        "kwargs": kwargs,
        "headers": {HEADER_KEY: key, HEADER_KEY_SOURCE: "option"},
        "exchange": req.delivery_info.get("exchange"),
        "routing_key": req.delivery_info.get("routing_key"),
        "priority": req.delivery_info.get("priority"),
    }
    workflow = messages._workflow(lambda name: getattr(req, name, None))
    if workflow:
        message["workflow"] = workflow
    return canonical_json(message)


@given(
    args=st.lists(st.integers() | st.text() | st.none(), min_size=1, max_size=4),
    kwargs=st.dictionaries(st.sampled_from(["a", "zz", "é", "kwargs"]), st.text(), max_size=3),
    chained=st.booleans(),
)
def test_the_spliced_message_is_the_whole_message_canonical_json(
    args: list[object], kwargs: dict[str, object], chained: bool
) -> None:
    workflow = (
        {"chain": [{"task": "next", "args": [1]}], "root_id": "r", "parent_id": "p"}
        if chained
        else {}
    )
    req = request(**workflow)
    payload = encode_payload("shop.order", body, args, kwargs)
    text = messages.from_request("shop.order", req, payload, "order:1", KeySource.OPTION)
    assert text == whole(req, args, kwargs)
    assert ("workflow" in serialization.loads(text)) is chained


@given(
    names=st.lists(st.text(), min_size=4, max_size=4),
    exchange=st.text() | st.none(),
    routing_key=st.text() | st.none(),
    priority=st.integers() | st.none() | st.booleans() | st.floats(allow_nan=False),
)
def test_the_delivery_fields_are_written_as_the_encoder_writes_them(
    names: list[str], exchange: str | None, routing_key: str | None, priority: object
) -> None:
    """Quotes, control characters, non-ASCII text, None and numbers of every kind: the
    message's own fields come out as one canonical JSON pass writes them."""
    task, task_id, key, arg = names
    req = request(
        id=task_id,
        delivery_info={"exchange": exchange, "routing_key": routing_key, "priority": priority},
    )
    payload = encode_payload(task, body, [arg], {})
    text = messages.from_request(task, req, payload, key, KeySource.OPTION)
    assert text == whole(req, [arg], {}, key=key, task=task)


def test_a_workflow_json_cannot_hold_is_left_out_as_before() -> None:
    req = request(callbacks=[{"task": "next", "args": [object()]}])
    payload = encode_payload("shop.order", body, [1], {})
    text = messages.from_request("shop.order", req, payload, "order:1", KeySource.OPTION)
    assert "workflow" not in serialization.loads(text)
    assert text == whole(request(), [1], {})


def test_fields_equal_as_python_values_are_written_each_as_its_own_json() -> None:
    """``True == 1 == 1.0``: the envelope texts a worker keeps per queue and task must not
    hand one's text to another."""
    for priority, written in ((1, 1), (True, True), (1.0, 1.0), (1, 1)):
        req = request(delivery_info={"exchange": "", "routing_key": "q", "priority": priority})
        payload = encode_payload("shop.order", body, [1], {})
        text = messages.from_request("shop.order", req, payload, "order:1", KeySource.OPTION)
        assert text == whole(req, [1], {})
        assert repr(serialization.loads(text)["priority"]) == repr(written)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"callbacks": [], "errbacks": None},  # an empty list is no workflow either
        {"chain": [{"task": "next", "args": [1]}], "root_id": "r", "parent_id": "p"},
        {"group": "g-1", "group_index": 0, "root_id": "r"},
    ],
)
def test_a_celery_request_s_workflow_is_read_as_from_any_request(fields: dict[str, object]) -> None:
    """A worker's request is Celery's Context, whose workflow fields default to None on the
    class (read all at once); any other request object is read field by field."""
    base = {"id": "task-1", "delivery_info": {"exchange": "", "routing_key": "orders"}}
    context = Context({**base, **fields})
    payload = encode_payload("shop.order", body, [1], {})
    text = messages.from_request("shop.order", context, payload, "order:1", KeySource.OPTION)
    assert text == whole(request(**{**base, **fields}), [1], {})
    workflow = fields.get("chain") or fields.get("group")
    assert ("workflow" in serialization.loads(text)) is bool(workflow)
