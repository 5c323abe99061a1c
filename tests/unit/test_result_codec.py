"""Results are kept for duplicates as Celery's result backend prepares them (ResultCodec)."""

from __future__ import annotations

from datetime import datetime, timezone
from decimal import Decimal

import pytest
from celery import Celery
from celery.result import AsyncResult, GroupResult

from celery_guard.serialization import ENVELOPE, ResultCodec, loads


def app_with(serializer: str = "json") -> Celery:
    app = Celery("codec", set_as_current=False)
    app.conf.update(
        result_serializer=serializer,
        result_accept_content=["json", serializer],
        result_backend="cache+memory://",
    )
    return app


def test_plain_json_results_stay_plain_json() -> None:
    codec = ResultCodec(app_with())
    value = {"charged": 100, "at": datetime(2026, 1, 2, tzinfo=timezone.utc), "n": Decimal("1.5")}
    text = codec.dumps(value)
    assert loads(text)["charged"] == 100  # readable as JSON in the store
    assert codec.loads(text) == value


@pytest.mark.parametrize("serializer", ["json", "pickle"])
def test_a_body_that_returns_nothing_is_stored_as_its_serializer_writes_none(
    serializer: str,
) -> None:
    codec = ResultCodec(app_with(serializer))
    text = codec.dumps(None)
    assert codec.loads(text) is None
    if serializer == "json":
        assert text == "null"
    else:  # kept in the serializer's envelope, like every other pickled value
        assert loads(text)[ENVELOPE] == "serialized"


def test_an_async_result_or_group_result_is_stored_as_its_tuple_and_restored() -> None:
    app = app_with()
    codec = ResultCodec(app)
    child = AsyncResult("child-id", app=app)
    one = AsyncResult("one-id", parent=child, app=app)
    many = GroupResult("group-id", [AsyncResult("a", app=app), AsyncResult("b", app=app)], app=app)
    for result in (one, many):
        text = codec.dumps(result)
        assert loads(text) == {ENVELOPE: "celery.result", "value": loads(codec_json(result))}
        restored = codec.loads(text)
        # app.AsyncResult / app.GroupResult are the app's own subclasses.
        assert isinstance(restored, GroupResult) == isinstance(result, GroupResult)
        assert isinstance(restored, (AsyncResult, GroupResult))
        assert restored.as_tuple() == result.as_tuple()
    assert codec.loads(codec.dumps(one)).parent.id == "child-id"


def codec_json(result: AsyncResult | GroupResult) -> str:
    from celery_guard.serialization import dumps

    return dumps(result.as_tuple())


def test_a_dict_that_looks_like_an_envelope_comes_back_unchanged() -> None:
    codec = ResultCodec(app_with())
    value = {ENVELOPE: "celery.result", "value": [["x", None], None]}
    assert codec.loads(codec.dumps(value)) == value


def test_a_pickle_result_serializer_round_trips_what_json_cannot() -> None:
    codec = ResultCodec(app_with("pickle"))
    value = {"tuple": (1, 2), "set": {3}}
    text = codec.dumps(value)
    assert loads(text)[ENVELOPE] == "serialized"  # still JSON text in the store
    assert codec.loads(text) == value


@pytest.mark.parametrize("serializer", ["json", "pickle"])
def test_a_result_the_backend_refuses_is_a_type_error(serializer: str) -> None:
    codec = ResultCodec(app_with(serializer))
    with pytest.raises(TypeError):
        codec.dumps(lambda: None)
