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
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

from django_skipqueue.exceptions import InvalidJobError

JSONValue: TypeAlias = "None | bool | int | float | str | list[JSONValue] | dict[str, JSONValue]"

_MAX_DEPTH = 64


def normalize(value: Any, where: str, depth: int = 0) -> JSONValue:
    """`value` as plain JSON data (tuples become lists), or InvalidJobError naming `where`."""
    if value is None or isinstance(value, (bool, int)):
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
                raise InvalidJobError(
                    f"{where} has the key {key!r} ({type(key).__name__}); JSON object keys "
                    f"must be strings, or the value would come back with another key"
                )
            _check_text(key, f"a key of {where}")
            result[key] = normalize(item, f"{where}[{key!r}]", depth + 1)
        return result
    raise InvalidJobError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which is not "
        f"JSON; pass plain data (str, int, float, bool, None, list, dict), such as an id "
        f"or an ISO 8601 string"
    )


def _check_text(text: str, where: str) -> None:
    if "\x00" in text:
        raise InvalidJobError(f"{where} contains a NUL character (\\x00), which jsonb rejects")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidJobError(f"{where} is not valid Unicode text ({error.reason})") from None


#: Compact UTF-8 JSON, as sizes are counted (one encoder, built once).
_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def encoded_size(value: JSONValue) -> int:
    """Bytes of the compact UTF-8 JSON text of `value`."""
    return len(_COMPACT.encode(value).encode("utf-8"))


def encode_arguments(
    args: Sequence[Any], kwargs: Mapping[str, Any], *, limit: int
) -> tuple[list[JSONValue], dict[str, JSONValue], str, str]:
    """Checked args and kwargs, and their JSON texts; refused if together over `limit` bytes.

    The size counted is that of `[args, kwargs]` in compact UTF-8 JSON.
    """
    plain_args = [normalize(value, f"argument {index}") for index, value in enumerate(args)]
    plain_kwargs = {}
    for name, value in kwargs.items():
        plain_kwargs[name] = normalize(value, f"argument {name!r}")
    args_json, kwargs_json = _COMPACT.encode(plain_args), _COMPACT.encode(plain_kwargs)
    size = len(args_json) + len(kwargs_json) + 3  # "[", ",", "]"
    if not (args_json.isascii() and kwargs_json.isascii()):
        size = len(args_json.encode("utf-8")) + len(kwargs_json.encode("utf-8")) + 3
    if size > limit:
        raise InvalidJobError(
            f"the arguments encode to {size} bytes of JSON, over the limit of {limit} "
            f"(SKIPQUEUE['MAX_PAYLOAD_BYTES']); store large data elsewhere and pass its id"
        )
    return plain_args, plain_kwargs, args_json, kwargs_json


def normalize_arguments(
    args: Sequence[Any], kwargs: Mapping[str, Any], *, limit: int
) -> tuple[list[JSONValue], dict[str, JSONValue]]:
    """Checked, JSON-ready args and kwargs, refused if together they exceed `limit` bytes."""
    plain_args, plain_kwargs, _, _ = encode_arguments(args, kwargs, limit=limit)
    return plain_args, plain_kwargs
