"""Redaction: keep secrets out of stored errors, logs and the admin.

Tasks should receive ids, not secrets; this is the safety net. Keys are matched without
regard to case, as substrings ("api_key" also hides "stripe_api_key").
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from django_skipqueue.conf import get_settings

MASK = "***"
_DSN_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^:/@\s]+:)([^@\s/]+)(@)", re.IGNORECASE)


def _is_secret(key: str, keys: Iterable[str]) -> bool:
    lowered = key.lower()
    return any(secret in lowered for secret in keys)


def redact(value: Any, keys: Iterable[str] | None = None) -> Any:
    """`value` with the values of secret-looking keys replaced by '***', recursively."""
    keys = tuple(k.lower() for k in (keys if keys is not None else get_settings().REDACT_KEYS))
    if isinstance(value, dict):
        return {
            key: MASK if isinstance(key, str) and _is_secret(key, keys) else redact(item, keys)
            for key, item in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [redact(item, keys) for item in value]
    if isinstance(value, str):
        return redact_text(value, keys)
    return value


def redact_text(text: str, keys: Iterable[str] | None = None) -> str:
    """`text` with URL passwords and `key=value` / `"key": "value"` secrets masked."""
    keys = tuple(k.lower() for k in (keys if keys is not None else get_settings().REDACT_KEYS))
    text = _DSN_PASSWORD.sub(rf"\1{MASK}\3", text)
    if not keys:
        return text
    names = "|".join(re.escape(key) for key in keys)
    pattern = re.compile(
        rf"""(["']?[\w-]*(?:{names})[\w-]*["']?\s*[:=]\s*)(["'][^"']*["']|[^\s,;&)}}\]]+)""",
        re.IGNORECASE,
    )
    return pattern.sub(rf"\1{MASK}", text)
