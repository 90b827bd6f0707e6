"""JSON payloads: what a job's arguments and return value may hold, checked before SQL.

Arguments are stored as `jsonb` and must come back as they went in. Anything that
would not survive the round trip is refused with an error naming the argument:
objects, sets, bytes, Decimal, datetimes, NaN and infinities, non-string dict keys,
strings holding NUL (jsonb rejects \\u0000) or lone surrogates. Tuples are accepted
and come back as lists, as JSON has no tuple.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal
from json.encoder import encode_basestring
from typing import Any, TypeAlias

from django.db import models

from django_skipqueue.conf import get_settings
from django_skipqueue.exceptions import InvalidJobError, NotJSONError

JSONValue: TypeAlias = "None | bool | int | float | str | list[JSONValue] | dict[str, JSONValue]"

_MAX_DEPTH = 64
#: Below this many bits an int has fewer than 4,300 digits: no need to count them.
_INT_BITS_CHECKED = 14_000


def _int_max_digits() -> int:
    """Python's limit on the digits of an int read from text (0 means none)."""
    limit = getattr(sys, "get_int_max_str_digits", lambda: 0)()
    return limit or 10**9


def _digits(value: int) -> str:
    try:
        return str(abs(value))
    except ValueError:  # over the limit: so many digits that str() refuses
        return "9" * (_int_max_digits() + 1)


def normalize(value: Any, where: str, depth: int = 0) -> JSONValue:
    """`value` as plain JSON data (tuples become lists), or InvalidJobError naming `where`."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if value.bit_length() > _INT_BITS_CHECKED and len(_digits(value)) > _int_max_digits():
            raise InvalidJobError(
                f"{where} is an integer of more than {_int_max_digits()} digits, which "
                f"Python cannot read back from JSON (sys.get_int_max_str_digits()); pass it "
                f"as a string"
            )
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidJobError(f"{where} is {value!r}, which JSON cannot hold")
        return value
    if isinstance(value, str):
        _check_text(value, where)
        return value
    if depth >= _MAX_DEPTH:
        raise InvalidJobError(f"{where} is nested more than {_MAX_DEPTH} levels deep")
    if isinstance(value, (list, tuple)):
        return [normalize(item, f"{where}[{index}]", depth + 1) for index, item in enumerate(value)]
    if isinstance(value, dict):
        result: dict[str, JSONValue] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise NotJSONError(
                    f"{where} has the key {key!r} ({type(key).__name__}); JSON object keys "
                    f"must be strings, or the value would come back with another key",
                    kind=type(key),
                )
            _check_text(key, f"a key of {where}")
            result[key] = normalize(item, f"{where}[{key!r}]", depth + 1)
        return result
    kind = type(value)
    raise NotJSONError(  # with json's own words, as Django's backends record them too
        f"{where} is a {kind.__module__}.{kind.__qualname__} (Object of type "
        f"{kind.__name__} is not JSON serializable); pass plain data (str, int, float, "
        "bool, None, list, dict), such as an id or an ISO 8601 string",
        kind=kind,
    )


def _check_text(text: str, where: str) -> None:
    if "\x00" in text:
        raise InvalidJobError(f"{where} contains a NUL character (\\x00), which jsonb rejects")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidJobError(f"{where} is not valid Unicode text ({error.reason})") from None


def storable_text(text: str) -> str:
    """`text` as PostgreSQL can store it: NUL and lone surrogates written as escapes.

    For text the library writes itself (error messages, tracebacks), where refusing is
    no option: the stored history must show the real error.
    """
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def encode(value: JSONValue) -> str:
    """`value` (plain JSON data) as JSON text exactly as jsonb prints it back.

    jsonb keeps numbers as `numeric` and prints them without an exponent, with `, ` and
    `: ` between items. So a float in exponent form is written out in full here: its
    stored size is then the size of this text, and a float that jsonb would print as a
    whole number (`1e20` as `100000000000000000000`) keeps a `.0`, so that it comes back
    a float, not an int.
    """
    text = _encode_fast(value)
    if "e+" in text or "e-" in text:  # a float in exponent form (or a string with those)
        text = _encode_exact(value)
    return text


def stored_size(text: str) -> int:
    """Bytes of `text` (from `encode`) in UTF-8: what the database's ceiling counts."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def float_text(value: float) -> str:
    """A float as jsonb prints it: plain decimal digits, never an exponent."""
    text = float.__repr__(value)
    if "e" not in text:
        return text
    plain = format(Decimal(text), "f")  # the same decimal number, written out
    return plain if "." in plain else plain + ".0"


#: jsonb's own text form: `, ` and `: ` separators, UTF-8 kept (one encoder, built once).
_ENCODER = json.JSONEncoder(ensure_ascii=False, check_circular=False, allow_nan=False)


def _c_encoder() -> Callable[[Any], str]:
    """`_ENCODER.encode`, with its C iterator built once: JSONEncoder.encode builds one
    on every call, which was a sixth of a bulk enqueue (the output is the same)."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # no C accelerator: the plain encoder
        return _ENCODER.encode
    iterate = make(None, _ENCODER.default, encode_basestring, None,
                   ": ", ", ", False, False, False)  # fmt: skip

    def encode_fast(value: Any) -> str:
        if isinstance(value, str):
            return encode_basestring(value)
        return "".join(iterate(value, 0))

    return encode_fast


_encode_fast = _c_encoder()


def _encode_exact(value: Any) -> str:
    if isinstance(value, float):
        return float_text(value)
    if isinstance(value, str):
        return encode_basestring(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_encode_exact(item) for item in value) + "]"
    if isinstance(value, dict):
        items = (f"{encode_basestring(key)}: {_encode_exact(item)}" for key, item in value.items())
        return "{" + ", ".join(items) + "}"
    return _ENCODER.encode(value)  # None, bool, int


def encoded_size(value: JSONValue) -> int:
    """Bytes of `value` as the database stores it (jsonb's text form, in UTF-8)."""
    return stored_size(encode(value))


def check_stored_size(value: JSONValue, what: str) -> None:
    """InvalidJobError if `value` (a result) takes more than SKIPQUEUE['MAX_PAYLOAD_BYTES']
    as stored; None counts as jsonb's `null`, 4 bytes, as encoded_size(None) says."""
    limit = get_settings().MAX_PAYLOAD_BYTES
    size = 4 if value is None else encoded_size(value)
    if size > limit:
        raise InvalidJobError(
            f"{what} takes {size} bytes as stored (jsonb text), over the limit of {limit} "
            "(SKIPQUEUE['MAX_PAYLOAD_BYTES'])"
        )


def encode_arguments(
    args: Sequence[Any], kwargs: Mapping[str, Any], *, limit: int
) -> tuple[list[JSONValue], dict[str, JSONValue], str, str]:
    """Checked args and kwargs, and their JSON texts; refused if together over `limit` bytes.

    The size counted is what the database stores: the jsonb text of the args and of
    the kwargs (so a number written in exponent form counts at its full length).
    """
    plain_args = [normalize(value, f"argument {index}") for index, value in enumerate(args)]
    plain_kwargs = {}
    for name, value in kwargs.items():
        if not isinstance(name, str):
            raise InvalidJobError(f"the keyword argument name {name!r} is not a string")
        _check_text(name, f"the keyword argument name {name!r}")
        plain_kwargs[name] = normalize(value, f"argument {name!r}")
    # A call without positional or without keyword arguments (most have one of the two)
    # encodes that side as the text jsonb prints for it, without the encoder.
    args_json = encode(plain_args) if plain_args else "[]"
    kwargs_json = encode(plain_kwargs) if plain_kwargs else "{}"
    size = stored_size(args_json) + stored_size(kwargs_json)
    if size > limit:
        raise InvalidJobError(
            f"the arguments take {size} bytes as stored (jsonb text), over the limit of "
            f"{limit} (SKIPQUEUE['MAX_PAYLOAD_BYTES']); store large data elsewhere and "
            f"pass its id"
        )
    return plain_args, plain_kwargs, args_json, kwargs_json


def normalize_arguments(
    args: Sequence[Any], kwargs: Mapping[str, Any], *, limit: int
) -> tuple[list[JSONValue], dict[str, JSONValue]]:
    """Checked, JSON-ready args and kwargs, refused if together they exceed `limit` bytes."""
    plain_args, plain_kwargs, _, _ = encode_arguments(args, kwargs, limit=limit)
    return plain_args, plain_kwargs


class PayloadEncoder(json.JSONEncoder):
    """The ORM's encoder for payload columns: the same text as `encode` (for `save()`)."""

    def encode(self, o: Any) -> str:
        return encode(o)


class Undecodable(str):
    """A stored JSON value that Python cannot load, kept as its text, with the reason.

    Valid jsonb from another writer can still be out of Python's reach: an integer of
    more than 4,300 digits, or nesting deeper than the recursion limit. Loading such a
    row must not break a claim, a page of the admin or a result lookup, so the column
    holds this instead; the executor fails the job with `reason`.
    """

    reason: str

    def __new__(cls, text: str, reason: str) -> Undecodable:
        made = super().__new__(cls, text)
        made.reason = reason
        return made


class PayloadField(models.JSONField):
    """A jsonb column written with `encode` and loaded without ever raising.

    A value Python's json cannot load comes back as an `Undecodable`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("encoder", PayloadEncoder)
        super().__init__(*args, **kwargs)

    def deconstruct(self) -> Any:
        name, path, args, kwargs = super().deconstruct()
        if kwargs.get("encoder") is PayloadEncoder:
            del kwargs["encoder"]
        return name, path, args, kwargs

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        # Most job rows hold NULL, [] or {} in most of their nine payload columns: those
        # skip the decoder (a worker loads every column of each job it claims).
        if value is None:
            return None
        if self.decoder is None:
            if value == "[]":
                return []
            if value == "{}":
                return {}
        try:
            return super().from_db_value(value, expression, connection)
        except (ValueError, RecursionError) as error:
            reason = str(error) or type(error).__name__
            return Undecodable(value, f"{type(error).__name__}: {reason}")
