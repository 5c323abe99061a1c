"""Key resolution, validation and payload fingerprints."""

from __future__ import annotations

import datetime
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_guard import BY_ARGUMENTS, MAX_KEY_LENGTH, InvalidIdempotencyKey
from celery_guard.errors import ConfigurationError, UnserializableArguments
from celery_guard.keys import (
    bind_arguments,
    call_error,
    canonical_json,
    check_key_option,
    encode_payload,
    key_from_option,
    payload_fingerprint,
    validate_key,
)


def charge(order_id: int, amount: int, currency: str = "EUR") -> None:
    """A task body's signature, for binding."""


def plain(c: object, d: object, zz: object = (1, "x"), b: object = None) -> None:
    """Every parameter positional or keyword, two with defaults (bound without the bind)."""


def key(option: object, *args: object, **kwargs: object) -> str | None:
    return key_from_option(option, task_name="shop.charge", fun=charge, args=args, kwargs=kwargs)  # type: ignore[arg-type]


def test_format_string_binds_positional_and_keyword_arguments_alike() -> None:
    assert key("charge:{order_id}", 7, 10) == "charge:7"
    assert key("charge:{order_id}", order_id=7, amount=10) == "charge:7"
    assert key("charge:{order_id}:{currency}", 7, 10) == "charge:7:EUR"
    assert key("charge:{0}", 7, 10) == "charge:7"


def test_format_string_naming_a_missing_argument_is_a_clear_error() -> None:
    with pytest.raises(InvalidIdempotencyKey, match=r"cannot be formatted.*'customer'"):
        key("charge:{customer}", 7, 10)


def test_callable_option_gets_the_task_arguments() -> None:
    assert key(lambda order_id, amount: f"c-{order_id}-{amount}", 7, amount=10) == "c-7-10"


def test_callable_returning_a_non_string_is_refused() -> None:
    with pytest.raises(InvalidIdempotencyKey, match="must be a string, got int"):
        key(lambda order_id, amount: order_id, 7, 10)


def test_by_arguments_is_the_same_for_positional_and_keyword_calls() -> None:
    positional = key(BY_ARGUMENTS, 7, 10)
    keyword = key(BY_ARGUMENTS, amount=10, order_id=7)
    assert positional == keyword
    assert positional is not None and positional.startswith("shop.charge:")
    assert key(BY_ARGUMENTS, 7, 11) != positional


def test_no_option_means_no_key_here() -> None:
    assert key(None, 7, 10) is None


@pytest.mark.parametrize("bad", [None, 5, b"bytes", ""])
def test_validate_key_refuses_non_strings_and_empty(bad: object) -> None:
    with pytest.raises(InvalidIdempotencyKey):
        validate_key(bad)


def test_validate_key_refuses_keys_longer_than_the_column() -> None:
    assert validate_key("k" * MAX_KEY_LENGTH) == "k" * MAX_KEY_LENGTH
    with pytest.raises(InvalidIdempotencyKey, match=f"at most {MAX_KEY_LENGTH}"):
        validate_key("k" * (MAX_KEY_LENGTH + 1))


@pytest.mark.parametrize(
    ("bad", "message"),
    [("order:\x00:1", "must not contain NUL"), ("order:\ud800", "not valid Unicode text")],
)
def test_validate_key_refuses_what_the_store_cannot_hold(bad: str, message: str) -> None:
    """PostgreSQL refuses NUL in text and nothing encodes a lone surrogate as UTF-8: the
    worker's claim would fail on every delivery, so the caller hears of it instead."""
    with pytest.raises(InvalidIdempotencyKey, match=message):
        validate_key(bad)
    assert validate_key("订单:😀") == "订单:😀"


def test_arguments_that_cannot_be_utf8_are_unserializable() -> None:
    with pytest.raises(UnserializableArguments, match="surrogates not allowed"):
        payload_fingerprint("t", {"a": "\ud800"})


def test_fingerprint_covers_dates_and_uuids_but_refuses_arbitrary_objects() -> None:
    when = datetime.datetime(2026, 1, 2, 3, 4, 5)
    ident = uuid.UUID(int=5)
    assert payload_fingerprint("t", {"a": when, "b": ident}) == payload_fingerprint(
        "t", {"b": ident, "a": when}
    )
    with pytest.raises(UnserializableArguments, match="JSON-serializable"):
        payload_fingerprint("t", {"a": object()})


def test_arguments_that_do_not_fit_the_signature_are_fingerprinted_as_sent() -> None:
    assert bind_arguments(charge, (1, 2, 3, 4), {}) == {"args": [1, 2, 3, 4], "kwargs": {}}


def plain_call_error(fun: object, *args: object, **kwargs: object) -> str:
    """The message Python itself gives for this call (what plain Celery's worker raises)."""
    with pytest.raises(TypeError) as raised:
        fun(*args, **kwargs)  # type: ignore[operator]
    return str(raised.value)


@pytest.mark.parametrize("option", ["charge:{order_id}", BY_ARGUMENTS])
@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((7,), {}, "charge() missing 1 required positional argument: 'amount'"),
        ((), {}, "charge() missing 2 required positional arguments: 'order_id' and 'amount'"),
        ((7, 10, "EUR", 1), {}, "charge() takes from 2 to 3 positional arguments but 4 were given"),
        ((7, 10), {"tip": 1}, "charge() got an unexpected keyword argument 'tip'"),
        ((7, 10), {"order_id": 7}, "charge() got multiple values for argument 'order_id'"),
    ],
)
def test_a_key_option_over_arguments_that_do_not_fit_raises_the_calls_type_error(
    option: object, args: tuple[object, ...], kwargs: dict[str, object], message: str
) -> None:
    assert plain_call_error(charge, *args, **kwargs) == message
    with pytest.raises(TypeError) as raised:
        key(option, *args, **kwargs)
    assert type(raised.value) is TypeError and str(raised.value) == message


class ChargeTask:
    def run(self, order_id: int) -> None: ...


def test_a_bound_methods_type_error_does_not_count_self() -> None:
    method = ChargeTask().run
    message = "ChargeTask.run() missing 1 required positional argument: 'order_id'"
    assert plain_call_error(method) == message
    with pytest.raises(TypeError) as raised:
        bind_arguments(method, (), {}, strict=True)
    assert str(raised.value) == message
    assert bind_arguments(method, (5,), {}, strict=True) == {"order_id": 5}


def test_a_nested_functions_type_error_names_it_as_python_does() -> None:
    def inner(order_id: int) -> None: ...

    message = plain_call_error(inner)
    assert message.startswith("test_a_nested_functions_type_error_names_it_as_python_does.")
    error = call_error(inner, (), {})
    assert error is not None and str(error) == message


def test_call_error_is_none_for_arguments_that_fit() -> None:
    assert call_error(charge, (7,), {"amount": 1}) is None
    error = call_error(charge, (7,), {})
    assert isinstance(error, TypeError) and "'amount'" in str(error)


@pytest.mark.parametrize("bad", [5, "", "unclosed {brace", ["list"]])
def test_malformed_key_options_fail_at_definition(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="idempotency_key"):
        check_key_option("shop.charge", bad)


@given(
    order_id=st.integers(),
    amount=st.integers() | st.floats(allow_nan=False) | st.text(),
    currency=st.text(),
)
def test_fingerprint_depends_only_on_bound_values(
    order_id: int, amount: object, currency: str
) -> None:
    by_position = bind_arguments(charge, (order_id, amount, currency), {})
    by_name = bind_arguments(
        charge, (), {"currency": currency, "amount": amount, "order_id": order_id}
    )
    assert payload_fingerprint("t", by_position) == payload_fingerprint("t", by_name)


def variadic(
    a: object, b: object = 2, *rest: object, c: object, d: object = None, **extra: object
) -> None:
    """Every kind of parameter (positional or keyword, *args, keyword-only, **kwargs)."""


#: Values an argument may take: what canonical JSON writes, nested, with kombu's types.
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text()
    | st.datetimes()
    | st.uuids()
    | st.decimals(allow_nan=False, allow_infinity=False),
    lambda children: (
        st.lists(children, max_size=3)
        | st.tuples(children, children)
        | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=8,
)
names = st.sampled_from(["c", "d", "zz", "b", "é", "extra_1", "a_"])


@given(
    args=st.lists(json_values, max_size=5),
    kwargs=st.dictionaries(names, json_values, max_size=4),
)
def test_payload_serialized_once_gives_the_fingerprint_and_texts_of_separate_passes(
    args: list[object], kwargs: dict[str, object]
) -> None:
    for fun in (variadic, charge, plain):
        payload = encode_payload("t", fun, args, kwargs)
        bound = bind_arguments(fun, args, kwargs)
        assert payload.fingerprint == payload_fingerprint("t", bound)
        assert payload.args_json == canonical_json(list(args))
        assert payload.kwargs_json == canonical_json(kwargs)


def test_payload_refuses_what_the_fingerprint_refuses() -> None:
    with pytest.raises(UnserializableArguments, match="JSON-serializable"):
        encode_payload("t", charge, (object(), 1), {})
    with pytest.raises(UnserializableArguments):
        encode_payload("t", charge, (1, "\ud800"), {})  # a lone surrogate no database stores
