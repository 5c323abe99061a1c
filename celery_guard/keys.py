"""Idempotency keys and payload fingerprints.

Where a key comes from, in order: a per-call key (``apply_async(..., idempotency_key=...)``, carried
in a message header); the task option ``idempotency_key`` (a format string over the bound
arguments, a callable, or :data:`BY_ARGUMENTS`); else the Celery task id, which is always safe:
redeliveries, retries and re-publishes share it, while calls a user repeats on purpose do not.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import inspect
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from celery.utils.functional import head_from_fun

from celery_guard import serialization
from celery_guard.errors import ConfigurationError, InvalidIdempotencyKey, UnserializableArguments

#: Longest key the store's column holds.
MAX_KEY_LENGTH: Final = 255

#: Message headers carrying a key computed before the message was sent (per call, or the task
#: option evaluated by the producer); prefixed so they never shadow a Celery ``Context`` field.
HEADER_KEY: Final = "guard_idempotency_key"
HEADER_KEY_SOURCE: Final = "guard_key_source"


class _ByArguments:
    """Marker: derive the key from the task name and its canonical arguments."""

    _instance: _ByArguments | None = None

    def __new__(cls) -> _ByArguments:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "celery_guard.BY_ARGUMENTS"

    def __reduce__(self) -> str:
        return "BY_ARGUMENTS"


#: Task option value: the key is a fingerprint of the task name plus its canonical arguments.
BY_ARGUMENTS: Final = _ByArguments()

KeyOption = str | Callable[..., Any] | _ByArguments | None


class KeySource(str, enum.Enum):
    """Where an execution's key came from; decides whether a payload change is a conflict."""

    CALL = "call"
    OPTION = "option"
    TASK_ID = "task_id"


#: The sources by their header values: a dict lookup, not the enum's call, per delivery.
_KEY_SOURCES: Final = {source.value: source for source in KeySource}


def resolve_key(
    header_key: object,
    header_source: object,
    from_option: Callable[[], str | None],
    task_id: str,
) -> tuple[str, KeySource]:
    """The key a delivery runs under, and where it came from.

    One function for the worker (``GuardedTask``) and the producer (publish tracking), so both
    name the same row: the key header if the message has one, else the task option over the
    arguments, else the task id. Raises :class:`InvalidIdempotencyKey` (and, for
    :data:`BY_ARGUMENTS`, :class:`UnserializableArguments`) when the key cannot be used.
    """
    if header_key is not None:
        source = _KEY_SOURCES.get(header_source or "call")  # type: ignore[call-overload]
        if source is None:
            source = KeySource(header_source)  # raises the ValueError that names it
        return validate_key(header_key), source
    key = from_option()
    if key is not None:
        return key, KeySource.OPTION
    return task_id, KeySource.TASK_ID


def check_key_option(task_name: str, option: object) -> None:
    """Refuse a malformed ``idempotency_key`` task option when the task is defined."""
    if option is None or option is BY_ARGUMENTS or callable(option):
        return
    if not isinstance(option, str) or not option:
        raise ConfigurationError(
            f"task {task_name}: idempotency_key must be a format string, a callable or "
            f"celery_guard.BY_ARGUMENTS, got {option!r}"
        )
    try:
        list(string.Formatter().parse(option))
    except ValueError as exc:
        raise ConfigurationError(
            f"task {task_name}: idempotency_key {option!r} is not a valid format string: {exc}"
        ) from None


def validate_key(key: object) -> str:
    """Return ``key`` if it fits the store, else raise :class:`InvalidIdempotencyKey`."""
    if not isinstance(key, str):
        raise InvalidIdempotencyKey(
            f"idempotency key must be a string, got {type(key).__name__}: {key!r}"
        )
    if not key:
        raise InvalidIdempotencyKey("idempotency key must not be empty")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidIdempotencyKey(
            f"idempotency key is {len(key)} characters long; the store holds at most "
            f"{MAX_KEY_LENGTH} (key starts {key[:40]!r})"
        )
    if "\x00" in key:
        # PostgreSQL text cannot hold NUL: the claim would fail in the worker, every time.
        raise InvalidIdempotencyKey(f"idempotency key must not contain NUL characters: {key!r}")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidIdempotencyKey(
            f"idempotency key is not valid Unicode text (it cannot be stored as UTF-8: "
            f"{exc.reason}): {key!r}"
        ) from None
    return key


@functools.lru_cache(maxsize=1024)
def _signature(fun: Callable[..., Any]) -> inspect.Signature:
    # Computing a signature costs more than the claim's round trip; a task's never changes.
    return inspect.signature(fun)


@functools.lru_cache(maxsize=1024)
def _argument_checker(fun: Callable[..., Any]) -> Callable[..., Any]:
    # Celery's own check (Task.apply_async with ``typing`` on): a function with fun's signature
    # and an empty body, whose call raises the TypeError Python gives for the real call.
    checker: Callable[..., Any] = head_from_fun(fun, bound=inspect.ismethod(fun))
    return checker


def call_error(
    fun: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> TypeError | None:
    """The ``TypeError`` calling ``fun(*args, **kwargs)`` would raise for arguments that do not
    fit its signature (``"f() missing 1 required positional argument: 'x'"``), else ``None``."""
    try:
        _signature(fun).bind(*args, **kwargs)
    except TypeError as mismatch:
        try:
            _argument_checker(fun)(*args, **kwargs)
        except TypeError as exc:
            return TypeError(_qualified(fun, str(exc)))
        except Exception:  # a signature Celery's helper cannot copy
            pass
        return mismatch
    except ValueError:
        pass  # no signature to check against (a builtin): the call itself will tell
    return None


def _qualified(fun: Callable[..., Any], message: str) -> str:
    # Celery's copy of the signature knows only fun's __name__; Python's own message names its
    # __qualname__ (a method's class, an enclosing function), as the body's real call would.
    name = getattr(fun, "__name__", None)
    qualname = getattr(fun, "__qualname__", name)
    if name and qualname and qualname != name and message.startswith(f"{name}()"):
        return f"{qualname}{message[len(name) :]}"
    return message


def bind_arguments(
    fun: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    strict: bool = False,
) -> dict[str, Any]:
    """Arguments by parameter name, defaults applied, so positional and keyword calls agree.

    Arguments that do not fit the signature: with ``strict``, raises the ``TypeError`` the call
    would raise (the message plain Celery gives); otherwise they are keyed as sent, and the
    body's call raises that ``TypeError``.
    """
    try:
        bound = _signature(fun).bind(*args, **kwargs)
    except (TypeError, ValueError):
        error = call_error(fun, args, kwargs) if strict else None
        if error is not None:
            raise error from None
        return {"args": list(args), "kwargs": dict(kwargs)}
    bound.apply_defaults()
    return dict(bound.arguments)


def canonical_json(value: Any) -> str:
    """Stable JSON text (sorted keys, no spaces) through kombu's encoder (dates, UUIDs, ...)."""
    return serialization.dumps(value, canonical=True)


def payload_fingerprint(task_name: str, arguments: Mapping[str, Any]) -> str:
    """SHA-256 over the task name and its canonical arguments."""
    try:
        text = canonical_json({"task": task_name, "arguments": arguments})
        # Lone surrogates pass json.dumps but no database stores them (UnicodeEncodeError).
        encoded = text.encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise UnserializableArguments(
            f"arguments of {task_name} cannot be fingerprinted, they must be JSON-serializable: "
            f"{exc}"
        ) from exc
    return hashlib.sha256(encoded).hexdigest()


@dataclass(frozen=True)
class Payload:
    """A delivery's arguments serialized once, as canonical JSON.

    Its fingerprint (:func:`payload_fingerprint` of the bound arguments) and the texts of its
    positional and keyword arguments, which the stored message splices in as they are
    (:func:`celery_guard.messages.from_request`).
    """

    fingerprint: str
    #: Canonical JSON of the positional arguments (a list) and of the keyword arguments.
    args_json: str
    kwargs_json: str


class _Slot:
    """Stands for one argument while the signature binds: binding moves slots, not values."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def _value_text(value: Any) -> str:
    if type(value) is int:  # the commonest argument, as json writes it (bool is not int here)
        return int.__repr__(value)
    return serialization.dumps(value, canonical=True)


@functools.lru_cache(maxsize=4096)
def name_text(name: str) -> str:
    """An object key as canonical JSON writes it (parameter names: a small, fixed set)."""
    return serialization.dumps(name, canonical=True)


def _joined_object(items: list[tuple[str, str]]) -> str:
    # Canonical JSON sorts an object's keys as Python sorts the strings.
    items.sort()
    return "{" + ",".join([f"{name_text(name)}:{text}" for name, text in items]) + "}"


def _bound_text(value: Any) -> str:
    if type(value) is _Slot:
        return value.text
    if isinstance(value, tuple) and all(type(item) is _Slot for item in value):
        return "[" + ",".join([item.text for item in value]) + "]"  # *args
    if isinstance(value, dict) and all(type(item) is _Slot for item in value.values()):
        return _joined_object([(name, item.text) for name, item in value.items()])  # **kwargs
    return serialization.dumps(value, canonical=True)  # a default the signature applied


@functools.lru_cache(maxsize=1024)
def _plain_parameters(fun: Callable[..., Any]) -> tuple[tuple[str, ...], dict[str, Any]] | None:
    """``fun``'s parameter names and defaults when every one of them can be passed by position
    or by name (no ``*args``, ``**kwargs``, keyword- or positional-only ones), else ``None``."""
    try:
        parameters = list(_signature(fun).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(parameter.kind is not parameter.POSITIONAL_OR_KEYWORD for parameter in parameters):
        return None
    defaults = {p.name: p.default for p in parameters if p.default is not p.empty}
    return tuple(parameter.name for parameter in parameters), defaults


def _plainly_bound(
    plain: tuple[tuple[str, ...], dict[str, Any]],
    positional: list[_Slot],
    named: dict[str, _Slot],
) -> list[tuple[str, str]] | None:
    """The bound arguments' (name, text) pairs for a plain signature, as ``Signature.bind``
    and ``apply_defaults`` give them, without either (a tenth of a delivery's own Python
    calls); ``None`` where the arguments do not fit, which the bind then reports."""
    names, defaults = plain
    count = len(positional)
    if count > len(names):
        return None
    items = [(name, slot.text) for name, slot in zip(names[:count], positional, strict=True)]
    used = 0
    for name in names[count:]:
        slot = named.get(name)
        if slot is not None:
            items.append((name, slot.text))
            used += 1
        elif name in defaults:
            items.append((name, serialization.dumps(defaults[name], canonical=True)))
        else:
            return None  # missing
    return items if used == len(named) else None  # else unknown, or given twice


def _bound_json(
    fun: Callable[..., Any], positional: list[_Slot], named: dict[str, _Slot]
) -> str | None:
    """The bound arguments' canonical text, or ``None`` when they do not fit ``fun``."""
    plain = _plain_parameters(fun)
    items = None if plain is None else _plainly_bound(plain, positional, named)
    if items is not None:
        return _joined_object(items)
    try:
        bound = _signature(fun).bind(*positional, **named)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    return _joined_object([(name, _bound_text(value)) for name, value in bound.arguments.items()])


def encode_payload(
    task_name: str, fun: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Payload:
    """Serialize a delivery's arguments once: the fingerprint and the stored message's texts.

    Each argument is encoded once; the bound arguments' text (what the fingerprint hashes)
    and the message's ``args``/``kwargs`` texts are joined from those pieces, giving exactly
    the text :func:`canonical_json` gives for the whole (canonical text composes), so the
    fingerprint equals ``payload_fingerprint(task_name, bind_arguments(fun, args, kwargs))``.
    Raises :class:`UnserializableArguments` as :func:`payload_fingerprint` does.
    """
    try:
        positional = [_Slot(_value_text(value)) for value in args]
        named = {name: _Slot(_value_text(value)) for name, value in kwargs.items()}
        args_json = "[" + ",".join([slot.text for slot in positional]) + "]"
        kwargs_json = _joined_object([(name, slot.text) for name, slot in named.items()])
        arguments_json = _bound_json(fun, positional, named)
        if arguments_json is None:
            # Keyed as sent, as bind_arguments does; the body's call raises the TypeError.
            arguments_json = f'{{"args":{args_json},"kwargs":{kwargs_json}}}'
        text = f'{{"arguments":{arguments_json},"task":{name_text(task_name)}}}'
        # Lone surrogates pass json.dumps but no database stores them (UnicodeEncodeError).
        encoded = text.encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise UnserializableArguments(
            f"arguments of {task_name} cannot be fingerprinted, they must be JSON-serializable: "
            f"{exc}"
        ) from exc
    return Payload(hashlib.sha256(encoded).hexdigest(), args_json, kwargs_json)


def key_from_option(
    option: KeyOption,
    *,
    task_name: str,
    fun: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    arguments: Mapping[str, Any] | None = None,
) -> str | None:
    """The key a task option yields for these arguments, or ``None`` when there is no option.

    ``arguments`` is ``bind_arguments(fun, args, kwargs)`` when the caller has it already.
    Arguments that do not fit ``fun``'s signature raise the ``TypeError`` their call would.
    """
    if option is None:
        return None
    if option is BY_ARGUMENTS or isinstance(option, str):
        bound = bind_arguments(fun, args, kwargs, strict=True) if arguments is None else arguments
    if option is BY_ARGUMENTS:
        return f"{task_name}:{payload_fingerprint(task_name, bound)}"
    if isinstance(option, str):
        try:
            key = option.format(*args, **bound)
        except (KeyError, IndexError, AttributeError, ValueError) as exc:
            raise InvalidIdempotencyKey(
                f"task {task_name}: idempotency_key {option!r} cannot be formatted from the "
                f"arguments {sorted(bound)}: {exc!r}"
            ) from None
        return validate_key(key)
    if callable(option):
        return validate_key(option(*args, **kwargs))
    raise ConfigurationError(f"task {task_name}: unsupported idempotency_key {option!r}")
