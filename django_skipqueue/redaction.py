"""Redaction: keep secrets out of stored errors, logs and the admin.

Tasks should receive ids, not secrets; this is the safety net. It is table-driven:
`TEXT_RULES` lists each form of secret found in text, applied in order, and a test
runs every rule against a corpus of real-world forms (tests/test_redaction.py).

Key names are compared without regard to case or punctuation, as substrings:
"api_key" also hides "stripe_api_key", "apiKey", "x-api-key" and "X-API-Key".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from django_skipqueue.conf import get_settings

MASK = "***"

#: HTTP authentication schemes whose credentials follow them after a space.
AUTH_SCHEMES = ("Bearer", "Basic", "Digest", "Token", "Negotiate", "ApiKey")
_SCHEME = rf"(?:(?:{'|'.join(AUTH_SCHEMES)})\s+)"

#: A value after `key=` or `key:`: quoted (escaped quotes and all) or up to a delimiter.
_VALUE = r"""(?:"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|[^\s,;&)}\]]+)"""

_KEY_VALUE = re.compile(
    rf"""(?P<prefix>(?P<quote>["']?)(?P<name>[A-Za-z0-9_.-]+)(?P=quote)\s*[:=]\s*{_SCHEME}?)"""
    rf"""(?P<value>{_VALUE})""",
    re.IGNORECASE,
)


def _url_password(match: re.Match[str], keys: tuple[str, ...]) -> str:
    return f"{match['head']}{MASK}@"


def _scheme_credentials(match: re.Match[str], keys: tuple[str, ...]) -> str:
    return f"{match['scheme']}{MASK}"


def _key_value(match: re.Match[str], keys: tuple[str, ...]) -> str:
    if is_secret(match["name"], keys):
        return f"{match['prefix']}{MASK}"
    value = match["value"]  # not a secret itself, but a quoted value may hold one
    if len(value) >= 2 and value[0] in "\"'":
        value = value[0] + _redact_text(value[1:-1], keys) + value[-1]
    return match["prefix"] + value


Rule = tuple[str, re.Pattern[str], Callable[[re.Match[str], tuple[str, ...]], str]]

#: (what it masks, pattern, replacement), applied in this order.
TEXT_RULES: list[Rule] = [
    (
        "the password of a URL, with or without a user name (redis://:secret@host)",
        re.compile(r"(?P<head>\b[a-z][a-z0-9+.-]*://[^:/@\s]*:)[^@\s/]+@", re.IGNORECASE),
        _url_password,
    ),
    (
        '`key=value`, `key: value`, `"key": "value"` where the key looks secret; '
        "after `Authorization:`, the credentials that follow the scheme",
        _KEY_VALUE,
        _key_value,
    ),
    (
        "credentials after an authentication scheme anywhere (`Bearer <token>`)",
        re.compile(rf"(?P<scheme>\b(?:{'|'.join(AUTH_SCHEMES)})\s+)(?!\*\*\*)[^\s,;\"']+"),
        _scheme_credentials,
    ),
]


def _normal(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _keys(keys: Iterable[str] | None) -> tuple[str, ...]:
    given = keys if keys is not None else get_settings().REDACT_KEYS
    return tuple(normal for normal in (_normal(key) for key in given) if normal)


def is_secret(key: str, keys: Iterable[str]) -> bool:
    """True if `key` holds one of `keys` (both compared without case or punctuation)."""
    name = _normal(key)
    return any(secret in name for secret in keys)


def redact(value: Any, keys: Iterable[str] | None = None) -> Any:
    """`value` with the values of secret-looking keys replaced by '***', recursively."""
    return _redact(value, _keys(keys))


def _redact(value: Any, keys: tuple[str, ...]) -> Any:
    if isinstance(value, dict):
        return {
            key: MASK if isinstance(key, str) and is_secret(key, keys) else _redact(item, keys)
            for key, item in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [_redact(item, keys) for item in value]
    if isinstance(value, str):
        return _redact_text(value, keys)
    return value


def redact_text(text: str, keys: Iterable[str] | None = None) -> str:
    """`text` with every form in TEXT_RULES masked."""
    return _redact_text(text, _keys(keys))


def _redact_text(text: str, keys: tuple[str, ...]) -> str:
    for _, pattern, replace in TEXT_RULES:
        if pattern is _KEY_VALUE and not keys:
            continue
        text = pattern.sub(lambda match, r=replace: r(match, keys), text)  # type: ignore[misc]
    return text


#: A unique key's runs between separators, and what in a run may be a token: a part
#: (between `-` and `_`) of 8 or more characters that mixes letters and digits, or of 16
#: or more of any kind (a reset token, a session id, a digest, a UUID, a card number).
_KEY_RUN = re.compile(r"[^\s:/|,;.=@]+")
_TOKEN_PART = re.compile(
    r"(?=[^-_]*[A-Za-z])(?=[^-_]*[0-9])[^-_]{8,}|[^-_]{16,}",
)


def redact_key(key: str, keys: Iterable[str] | None = None) -> str:
    """A unique key as the admin shows it: `redact_text`, then each run that may hold a
    token masked whole. Words, short numbers and dates are kept, so `invoice_id=5`
    and `order-42:2024-06-01` read as written; `reset:user:42:Zt9xQ2vLp8` shows
    `reset:user:42:***`."""
    text = _redact_text(key, _keys(keys))
    return _KEY_RUN.sub(
        lambda run: MASK if _TOKEN_PART.search(f"-{run[0]}-") and run[0] != MASK else run[0],
        text,
    )
