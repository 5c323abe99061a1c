"""Error classification and full-jitter backoff, pure and deterministic."""

from __future__ import annotations

import random
import re
import statistics
from pathlib import Path

import pytest
from celery.exceptions import SoftTimeLimitExceeded

from celery_guard import ConfigurationError, IdempotencyConflict, PermanentError, TransientError
from celery_guard.policy import (
    DEFAULT_PERMANENT,
    DEFAULT_TRANSIENT,
    ErrorClass,
    ErrorPolicy,
    decide,
    full_jitter,
    import_classes,
)

TRANSIENT, PERMANENT = ErrorClass.TRANSIENT, ErrorClass.PERMANENT


class HTTPError(Exception):
    def __init__(self, status_code: int) -> None:
        super().__init__(status_code)
        self.status_code = status_code


class Response:
    def __init__(self, status: int) -> None:
        self.status = status


class ClientError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.response = Response(status)


class PaymentDeclined(ValueError):
    """A business rule, but the team wants it retried (the provider flips its mind)."""


class RateLimited(PaymentDeclined):
    pass


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (ConnectionError("reset"), TRANSIENT),
        (TimeoutError(), TRANSIENT),
        (SoftTimeLimitExceeded(), TRANSIENT),
        (TransientError(), TRANSIENT),
        (ValueError("bad"), PERMANENT),
        (KeyError("missing"), PERMANENT),
        (TypeError("wrong"), PERMANENT),
        (PermanentError(), PERMANENT),
        (IdempotencyConflict("k", "a", "b"), PERMANENT),
        (HTTPError(503), TRANSIENT),
        (HTTPError(429), TRANSIENT),
        (HTTPError(404), PERMANENT),
        (ClientError(500), TRANSIENT),
        (ClientError(422), PERMANENT),
        (RuntimeError("unknown"), TRANSIENT),
        # Programming errors: a retry runs the same code again.
        (NameError("name 'x' is not defined"), PERMANENT),
        (UnboundLocalError("x"), PERMANENT),
        (AttributeError("'NoneType' object has no attribute 'id'"), PERMANENT),
        (ImportError("cannot import name 'y'"), PERMANENT),
        (ModuleNotFoundError("No module named 'z'"), PERMANENT),
        (SyntaxError("invalid syntax"), PERMANENT),
        (IndentationError("unexpected indent"), PERMANENT),
        (NotImplementedError(), PERMANENT),
        (AssertionError("invariant"), PERMANENT),
    ],
)
def test_documented_defaults(exc: BaseException, expected: ErrorClass) -> None:
    assert ErrorPolicy().classify(exc) is expected


def test_the_default_for_unknown_errors_is_configurable() -> None:
    assert ErrorPolicy(default=PERMANENT).classify(RuntimeError()) is PERMANENT


def test_declared_classes_beat_defaults_and_the_most_specific_wins() -> None:
    app = ErrorPolicy().with_layer(transient=[PaymentDeclined])
    assert app.classify(PaymentDeclined()) is TRANSIENT
    assert app.classify(ValueError()) is PERMANENT
    task = app.with_layer(permanent=[RateLimited])
    assert task.classify(RateLimited()) is PERMANENT, "the task's layer comes first"
    assert task.classify(PaymentDeclined()) is TRANSIENT
    both = ErrorPolicy().with_layer(transient=[ValueError], permanent=[PaymentDeclined])
    assert both.classify(RateLimited()) is PERMANENT, "nearer in the MRO wins"


class StaleClientError(AttributeError):
    """A library's error that a retry fixes, although it derives from a programming error."""


@pytest.mark.parametrize("error", [NameError, AttributeError, ImportError, AssertionError])
def test_a_programming_error_default_is_overridden_by_the_app_and_the_task(
    error: type[Exception],
) -> None:
    assert ErrorPolicy().classify(error()) is PERMANENT
    app = ErrorPolicy().with_layer(transient=[error])
    assert app.classify(error()) is TRANSIENT, "the app's guard_transient_errors come first"
    task = ErrorPolicy().with_layer(permanent=[ValueError]).with_layer(transient=[error])
    assert task.classify(error()) is TRANSIENT, "a task's transient_errors come first"
    back = app.with_layer(permanent=[error])
    assert back.classify(error()) is PERMANENT, "and a task can take it back from the app"


def test_a_subclass_listed_transient_beats_its_permanent_builtin_base() -> None:
    policy = ErrorPolicy().with_layer(transient=[StaleClientError])
    assert policy.classify(StaleClientError()) is TRANSIENT
    assert policy.classify(AttributeError()) is PERMANENT


def test_the_default_error_class_does_not_reach_the_builtins() -> None:
    # guard_default_error_class only decides what nothing else recognises.
    assert ErrorPolicy(default=TRANSIENT).classify(NameError()) is PERMANENT
    assert ErrorPolicy(default=PERMANENT).classify(RuntimeError()) is PERMANENT
    assert ErrorPolicy(default=TRANSIENT).classify(RuntimeError()) is TRANSIENT


def test_full_jitter_stays_within_its_bound_and_is_capped() -> None:
    rng = random.Random(1234)
    for attempt in range(1, 12):
        ceiling = min(30.0, 0.5 * 2**attempt)
        samples = [full_jitter(attempt, base=0.5, cap=30.0, rng=rng) for _ in range(2000)]
        assert min(samples) >= 0.0
        assert max(samples) <= ceiling
        # Uniform on [0, ceiling]: mean near ceiling / 2, and the samples spread over it.
        assert statistics.fmean(samples) == pytest.approx(ceiling / 2, rel=0.08)
        assert max(samples) > 0.95 * ceiling and min(samples) < 0.05 * ceiling
        assert statistics.pstdev(samples) == pytest.approx(ceiling / 12**0.5, rel=0.08)


def test_full_jitter_is_deterministic_for_a_seeded_source() -> None:
    first = [full_jitter(3, base=1, cap=10, rng=random.Random(7)) for _ in range(3)]
    assert first == [full_jitter(3, base=1, cap=10, rng=random.Random(7)) for _ in range(3)]


def test_decide_retries_transient_until_the_limit_and_dead_letters_the_rest() -> None:
    rng = random.Random(3)
    retry = decide(TRANSIENT, attempts=2, max_attempts=5, base=1, cap=60, rng=rng)
    assert retry.action == "retry" and retry.delay is not None and 0 <= retry.delay <= 4
    exhausted = decide(TRANSIENT, attempts=5, max_attempts=5, base=1, cap=60, rng=rng)
    assert exhausted.action == "dead_letter" and "exhausted" in exhausted.reason
    permanent = decide(PERMANENT, attempts=1, max_attempts=5, base=1, cap=60, rng=rng)
    assert permanent.action == "dead_letter" and permanent.delay is None


def test_exception_classes_can_be_named_in_settings() -> None:
    assert import_classes("guard_transient_errors", ["builtins:ConnectionError"]) == (
        ConnectionError,
    )
    assert import_classes("guard_permanent_errors", "builtins.LookupError") == (LookupError,)
    with pytest.raises(ConfigurationError, match="cannot import"):
        import_classes("guard_transient_errors", ["nowhere.Nothing"])
    with pytest.raises(ConfigurationError, match="not an exception class"):
        import_classes("guard_transient_errors", [int])


def test_the_docs_table_lists_every_built_in_default_with_its_class() -> None:
    doc = Path(__file__).resolve().parents[2] / "docs" / "failure-policy.md"
    section = doc.read_text().split("## The built-in defaults", 1)[1].split("\n## ", 1)[0]
    documented: dict[str, str] = {}
    for row in re.findall(r"^\| `([\w.]+)`[^|]*\| (transient|permanent) \|", section, re.M):
        documented[row[0].rsplit(".", 1)[-1]] = row[1]
    expected = {cls.__name__: "transient" for cls in DEFAULT_TRANSIENT} | {
        cls.__name__: "permanent" for cls in DEFAULT_PERMANENT
    }
    assert documented == expected, "docs/failure-policy.md's table differs from policy.py"
