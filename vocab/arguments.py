"""Argument checks: strict types and ranges, each failure a typed error that names the call, the
argument and the rule.

Every public call of the request, the pool and the manager runs its checks before it changes
anything (`pagedkv.call_arguments` lists them call by call), and the spec runs the same ones, so
both refuse the same input in the same words. The types are strict:

- an int is an `int` and not a `bool`, so floats, NaN and infinities are refused too;
- a flag is a `bool`; an id, a multimodal hash or a cache salt is a `str`;
- a token id is an int in `[0, MAX_TOKEN_ID]`, a LoRA id an int in `[1, MAX_LORA_ID]`.

A value of the wrong type raises `ArgumentTypeError`; one of the right type outside its range
raises `InvalidArgumentError`. Messages read `<call>: <argument> must be <rule>, got <value>`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from pagedkv.vocab.errors import ArgumentTypeError, InvalidArgumentError

T = TypeVar("T")

MAX_TOKEN_ID = 2**31 - 1
"""The largest token id: vLLM keeps token ids in int32 buffers. In `[0, MAX_TOKEN_ID]` CPython's
`hash()` of an id is the id itself, so the `builtin` block hash never confuses two token ids
(below 0 it would: `hash(-1) == hash(-2)`)."""

MAX_LORA_ID = 2**31 - 1
"""The largest LoRA id (an int32, as vLLM's LoRA slots hold it); ids start at 1."""

TOKEN_ID_RULE = f"an int in [0, {MAX_TOKEN_ID}]"

_MAX_SHOWN = 60  # characters of a refused value's repr in a message


def describe(value: object, *, secret: bool = False) -> str:
    """A short rendering of a refused value: `-1`, `None`, `2.0 (float)`, `'x' (str)`.

    A `secret` value (a cache salt) shows only its type, never its contents.
    """
    kind = type(value).__name__
    if secret:
        return f"a {kind}"
    try:
        text = repr(value)
    except Exception:  # a hostile __repr__ must not hide the refusal
        text = f"<{kind} object>"
    if len(text) > _MAX_SHOWN:
        text = text[: _MAX_SHOWN - 3] + "..."
    return text if type(value) is int or value is None else f"{text} ({kind})"


def argument_error(
    call: str, argument: str, rule: str, value: object, *, type_ok: bool, context: str = ""
) -> InvalidArgumentError:
    """The error for `argument` of `call` breaking `rule`: `ArgumentTypeError` unless `type_ok`.

    `context` follows the call in the message (" for request 'r'").
    """
    secret = argument.endswith("cache_salt")
    message = f"{call}{context}: {argument} must be {rule}, got {describe(value, secret=secret)}"
    error_class = InvalidArgumentError if type_ok else ArgumentTypeError
    return error_class(message, call=call, argument=argument, rule=rule)


def per_group_error(
    call: str, argument: str, num_groups: int, value: object, *, context: str = ""
) -> InvalidArgumentError:
    """`argument` is not one iterable per KV cache group: a list or tuple is shown by its
    length, not its items (an adapter may have turned ids into block objects)."""
    rule = f"one iterable of blocks per KV cache group ({num_groups})"
    if isinstance(value, (list, tuple)):
        shown = f"a {type(value).__name__} of {len(value)}"
    else:
        shown = describe(value)
    message = f"{call}{context}: {argument} must be {rule}, got {shown}"
    return ArgumentTypeError(message, call=call, argument=argument, rule=rule)


def is_int(value: object) -> bool:
    """Whether `value` is an int and not a bool."""
    return type(value) is int or (isinstance(value, int) and not isinstance(value, bool))


def int_rule(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f"an int in [{minimum}, {maximum}]"
    if minimum is not None:
        return f"an int >= {minimum}"
    return "an int" if maximum is None else f"an int <= {maximum}"


def require_int(
    call: str,
    argument: str,
    value: object,
    minimum: int | None = None,
    maximum: int | None = None,
    *,
    context: str = "",
) -> int:
    """`value` if it is an int (not a bool) in `[minimum, maximum]` (either end may be open)."""
    if is_int(value):
        assert isinstance(value, int)
        if (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
            return value
        type_ok = True
    else:
        type_ok = False
    rule = int_rule(minimum, maximum)
    raise argument_error(call, argument, rule, value, type_ok=type_ok, context=context)


def require_bool(call: str, argument: str, value: object, *, context: str = "") -> bool:
    """`value` if it is a bool (not 0 or 1, not None)."""
    if isinstance(value, bool):
        return value
    raise argument_error(call, argument, "a bool", value, type_ok=False, context=context)


def require_str(call: str, argument: str, value: object, *, context: str = "") -> str:
    """`value` if it is a str."""
    if isinstance(value, str):
        return value
    raise argument_error(call, argument, "a str", value, type_ok=False, context=context)


def require_optional_str(
    call: str, argument: str, value: object, *, context: str = ""
) -> str | None:
    """`value` if it is a str or None."""
    if value is None or isinstance(value, str):
        return value
    raise argument_error(call, argument, "a str or None", value, type_ok=False, context=context)


def require_instance(
    call: str, argument: str, value: object, cls: type[T], *, context: str = ""
) -> T:
    """`value` if it is an instance of `cls` (named in the rule: "a Request")."""
    if isinstance(value, cls):
        return value
    rule = f"a {cls.__name__}"
    raise argument_error(call, argument, rule, value, type_ok=False, context=context)


def require_callable(
    call: str, argument: str, value: object, *, context: str = ""
) -> Callable[..., object]:
    """`value` if it can be called."""
    if callable(value):
        return value
    raise argument_error(call, argument, "callable", value, type_ok=False, context=context)


def require_iterable(call: str, argument: str, value: object, *, context: str = "") -> list[T]:
    """The items of `value` as a new list (read once, so an iterator works too).

    Raises:
        ArgumentTypeError: `value` cannot be iterated (None, an int, ...).
    """
    try:
        items: list[T] = list(value)  # type: ignore[call-overload]
    except TypeError:
        if hasattr(value, "__iter__"):
            raise  # an iterable whose own iteration failed: not ours to rename
        raise argument_error(
            call, argument, "an iterable", value, type_ok=False, context=context
        ) from None
    return items


def require_token_ids(
    call: str, argument: str, values: Iterable[object], *, context: str = ""
) -> tuple[int, ...]:
    """The token ids in `values` as a tuple, each an int in `[0, MAX_TOKEN_ID]`.

    `values` is any iterable but a str, bytes or bytearray (whose items are characters or
    bytes, never token ids); it is read once.

    Complexity: O(len(values)).
    """
    if isinstance(values, (str, bytes, bytearray)):
        raise argument_error(
            call, argument, "an iterable of token ids", values, type_ok=False, context=context
        )
    items: list[object] = require_iterable(call, argument, values, context=context)
    for token in items:
        if type(token) is not int or not 0 <= token <= MAX_TOKEN_ID:
            break
    else:
        return tuple(items)  # type: ignore[arg-type]
    # Some item is not a plain int in range: name the first bad one, or normalize int subclasses
    # (an IntEnum) to plain ints so that equal tokens always hash alike.
    return tuple(
        int(require_int(call, f"{argument}[{index}]", token, 0, MAX_TOKEN_ID, context=context))
        for index, token in enumerate(items)
    )
