"""celery_guard's signals: its own recorders called directly, a user's receivers as Celery does."""

from __future__ import annotations

import logging
import weakref
from typing import Any

import pytest

from celery_guard import metrics, signals
from celery_guard.signals import GuardSignal


def _connected(signal: GuardSignal) -> list[Any]:
    """The receivers connected through Celery's ``connect`` (weak references resolved)."""
    resolved = []
    for _, receiver in signal.receivers:
        if isinstance(receiver, weakref.ReferenceType):
            receiver = receiver()
        resolved.append(receiver)
    return resolved


def test_recorders_and_receivers_both_get_each_send_in_that_order() -> None:
    signal = GuardSignal(name="tests.signal")
    calls: list[tuple[str, Any, dict[str, Any]]] = []

    def recorder(sender: Any = None, **named: Any) -> None:
        calls.append(("recorder", sender, named))

    def receiver(sender: Any = None, **named: Any) -> str:
        calls.append(("receiver", sender, named))
        return "answer"

    signal.record_with(recorder)
    signal.connect(receiver, weak=False)
    responses = signal.send("the-task", key="k", outcome="completed")

    assert [name for name, _, _ in calls] == ["recorder", "receiver"]
    assert calls[0][1:] == ("the-task", {"key": "k", "outcome": "completed"})
    # A receiver is called as Celery calls it: with the signal among its arguments.
    assert calls[1][1] == "the-task"
    assert calls[1][2] == {"signal": signal, "key": "k", "outcome": "completed"}
    assert responses == [(receiver, "answer")]


def test_a_recorder_is_added_once_and_removed() -> None:
    signal = GuardSignal(name="tests.signal")
    seen: list[str] = []

    def recorder(sender: Any = None, **_: Any) -> None:
        seen.append(sender)

    assert not signal.listened
    signal.record_with(recorder)
    signal.record_with(recorder)
    assert signal.listened
    signal.send("once")
    assert seen == ["once"]

    signal.record_with(recorder, enabled=False)
    signal.record_with(recorder, enabled=False)
    assert not signal.listened
    assert signal.send("nobody") == []
    assert seen == ["once"]


def test_a_receiver_alone_makes_the_signal_listened() -> None:
    signal = GuardSignal(name="tests.signal")

    def receiver(sender: Any = None, **_: Any) -> None:
        return None

    signal.connect(receiver, weak=False)
    assert signal.listened
    signal.disconnect(receiver)
    assert not signal.listened


def test_a_raising_recorder_is_logged_and_stops_nothing(caplog: pytest.LogCaptureFixture) -> None:
    signal = GuardSignal(name="tests.signal")
    seen: list[str] = []

    def broken(sender: Any = None, **_: Any) -> None:
        raise RuntimeError("recorder bug")

    def recorder(sender: Any = None, **_: Any) -> None:
        seen.append("recorder")

    def receiver(sender: Any = None, **_: Any) -> None:
        seen.append("receiver")

    signal.record_with(broken)
    signal.record_with(recorder)
    signal.connect(receiver, weak=False)
    with caplog.at_level(logging.ERROR, logger="celery_guard.signals"):
        signal.send(None)

    assert seen == ["recorder", "receiver"]
    assert any("recorder bug" in (record.exc_text or "") for record in caplog.records)


def test_the_metrics_record_through_recorders_not_receivers() -> None:
    was_recording = metrics.record_outcome in signals.outcome.recorders
    try:
        metrics.connect_signals(True)
        assert metrics.record_outcome in signals.outcome.recorders
        assert metrics.record_claim in signals.claimed.recorders
        # Nothing of celery_guard's goes through Celery's dispatch, only a user's receivers.
        assert metrics.record_outcome not in _connected(signals.outcome)
        assert metrics.record_claim not in _connected(signals.claimed)

        metrics.connect_signals(False)
        assert metrics.record_outcome not in signals.outcome.recorders
        assert metrics.record_claim not in signals.claimed.recorders
        # What the worker's own heartbeat row reads stays recorded.
        assert metrics.record_fenced in signals.executions_fenced.recorders
    finally:
        metrics.connect_signals(was_recording)
