"""Redaction: keep secrets out of stored errors, logs and the admin.

Tasks should receive ids, not secrets; this is the safety net. It is table-driven:
`TEXT_RULES` lists each form of secret found in text, applied in order, and a test
runs every rule against a corpus of real-world forms (tests/core/test_redaction.py).

Key names are compared without regard to case or punctuation. A name of five
characters or more matches as a substring: "api_key" also hides "stripe_api_key",
"apiKey", "x-api-key" and "X-API-Key". A shorter one ("pass", "pwd", "auth") matches
only a whole word of the key (words split at punctuation, digits and camelCase), so
"pass" hides "db_pass" and "userPass" but not "passenger", "compass" or "bypass", and
"auth" hides "x-auth" but not "author".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

from django_skipqueue.conf import get_settings

MASK = "***"


class _LazyPattern:
    """A regular expression compiled on its first use. The patterns below take about
    5 ms to compile, and every process that imports the job manager imports this
    module, while most (a worker before its first failure, a web process that enqueues)
    never redact anything."""

    __slots__ = ("_args", "_compiled")

    def __init__(self, pattern: str, flags: int) -> None:
        self._args = (pattern, flags)
        self._compiled: re.Pattern[str] | None = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in self.__slots__:
            # Not a pattern's: a copy or an unpickling asks before the slots are set.
            raise AttributeError(name)
        if self._compiled is None:
            self._compiled = re.compile(*self._args)
        return getattr(self._compiled, name)


def _lazy(pattern: str, flags: int = 0) -> re.Pattern[str]:
    return cast("re.Pattern[str]", _LazyPattern(pattern, flags))


#: Names of at most this many characters match whole words only (see the docstring).
WORD_MATCH_MAX_LENGTH = 4

#: HTTP authentication schemes whose credentials follow them after a space.
AUTH_SCHEMES = ("Bearer", "Basic", "Digest", "Token", "Negotiate", "ApiKey")
_SCHEME = rf"(?:(?:{'|'.join(AUTH_SCHEMES)})\s+)"

#: URL query parameters that hold a secret though their names say little: Google's
#: `key=`, a signed URL's `sig=`, an OAuth callback's `code=`.
URL_SECRET_PARAMS = ("key", "sig", "code")

#: A value after `key=` or `key:`: quoted (escaped quotes and all, and JSON inside a
#: JSON string, whose quotes are escaped), a bracketed group (`auth=('u', 'pw')`), or
#: else its first character: an unquoted value runs up to a delimiter (_BARE), found
#: only when it is masked, so that scanning a long value again costs nothing.
_VALUE = (
    r'[bBrRuU]{0,2}(?:"""(?s:.){0,4000}?"""'  # Python's triple quotes, prefixed or not
    r"|'''(?s:.){0,4000}?''')"
    r'|[bBrRuU]{0,2}"(?:[^"\\]|\\.)*"'  # b"...", r"...": Python's prefixed strings too
    r"|[bBrRuU]{0,2}'(?:[^'\\]|\\.)*'"
    r'|\\"(?:[^"\\]|\\[^"])*\\"'
    r"|[A-Za-z_][A-Za-z0-9_.]{0,60}\([^()]{0,4000}\)"  # a call: SecretStr('...')
    r"|\([^()]{0,4000}\)|\[[^\[\]]{0,4000}\]|\{[^{}]{0,4000}\}"
    r"|[^\s,;&)}\]]"
)
_BARE = _lazy(r"[^\s,;&)}\]]*")
_LINE = _lazy(r"""[^\r\n;"'<>]*""")
#: A key's name, bare or quoted (`password`, `"password"`, `\"password\"`), never
#: the tail of a longer name (which would make a long word cost its length squared).
_NAME = r"""(?<![A-Za-z0-9_.-])(?P<quote>\\?["']|)(?P<name>[A-Za-z0-9_.-]+)(?P=quote)"""

_KEY_VALUE = _lazy(
    rf"(?P<prefix>{_NAME}\s*(?:=>|[:=])\s*{_SCHEME}?)(?P<value>{_VALUE})", re.IGNORECASE
)

#: The words of a key name: `userPass` -> user, Pass; `X-API-Key` -> X, API, Key.
_WORD = _lazy(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")


def _normal(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _keys(keys: Iterable[str] | None) -> tuple[str, ...]:
    given = keys if keys is not None else get_settings().REDACT_KEYS
    return tuple(normal for normal in (_normal(key) for key in given) if normal)


def is_secret(key: str, keys: Iterable[str]) -> bool:
    """True if `key` holds one of `keys` (both compared without case or punctuation; a
    name of at most WORD_MATCH_MAX_LENGTH characters must be a whole word of `key`)."""
    name = _normal(key)
    words: set[str] | None = None
    for secret in keys:
        if len(secret) > WORD_MATCH_MAX_LENGTH:
            if secret in name:
                return True
            continue
        if words is None:
            words = {word.lower() for word in _WORD.findall(key)}
        if secret in words:
            return True
        # An environment variable's style, all capitals (DBPASS, SMTPPASS, AUTHKEY): a
        # short name may start or end one of its words.
        if key.isupper() and any(w.startswith(secret) or w.endswith(secret) for w in words):
            return True
    return False


#: A replacement: the text for a match and where to go on from, or None for "not a
#: secret: keep the prefix and look into the value again" (it may hold `key=value` or
#: a URL of its own).
Replace = Callable[[re.Match[str], tuple[str, ...]], "tuple[str, int] | None"]


def _pem(match: re.Match[str], keys: tuple[str, ...]) -> tuple[str, int]:
    return f"{match['begin']}{MASK}{match['end'] or ''}", match.end()


def _url_password(match: re.Match[str], keys: tuple[str, ...]) -> tuple[str, int]:
    return f"{match['head']}{MASK}@", match.end()


def _url_token(match: re.Match[str], keys: tuple[str, ...]) -> tuple[str, int]:
    return f"{match['head']}{MASK}@", match.end()


def _query_value(match: re.Match[str], keys: tuple[str, ...]) -> tuple[str, int] | None:
    name = match["name"]
    if name.lower() in URL_SECRET_PARAMS or is_secret(name, keys):
        return f"{match['prefix']}{MASK}", match.end()
    return None


def _key_value(match: re.Match[str], keys: tuple[str, ...]) -> tuple[str, int] | None:
    value = match["value"]
    if is_secret(match["name"], keys):
        end = match.end()
        if len(value) == 1:  # unquoted: masked up to its delimiter
            prefix = match["prefix"]
            spaced = prefix[-1:].isspace() and prefix.rstrip()[-1:] in (":", "=", ">")
            # After `password: ` or `password = ` (prose, YAML, ini) a passphrase may hold
            # spaces: masked to the end of the line. `password=x user=y`: to the space.
            bare = (_LINE if spaced else _BARE).match(match.string, match.start("value"))
            end = bare.end() if bare else end
        return f"{match['prefix']}{MASK}", end
    if len(value) >= 2 and value[0] in "\"'" and value[-1] == value[0]:
        # Not a secret itself, but a quoted value may hold one.
        inner = _redact_text(value[1:-1], keys)
        return match["prefix"] + value[0] + inner + value[-1], match.end()
    return None


def _scheme_credentials(match: re.Match[str], keys: tuple[str, ...]) -> tuple[str, int]:
    return f"{match['scheme']}{MASK}", match.end()


def _whole(match: re.Match[str], keys: tuple[str, ...]) -> tuple[str, int]:
    return MASK, match.end()


def _block(match: re.Match[str], keys: tuple[str, ...]) -> tuple[str, int] | None:
    """A YAML block scalar under a secret key: every indented line of it masked."""
    if not is_secret(match["name"], keys):
        return None
    newline = "\n" if match["value"].endswith("\n") else ""
    return f"{match['prefix']}{match['indent']}  {MASK}{newline}", match.end()


def _credentials(match: re.Match[str], keys: tuple[str, ...]) -> tuple[str, int]:
    return f"{match['head']}{MASK}@", match.end()


Rule = tuple[str, re.Pattern[str], Replace]

#: (what it masks, pattern, replacement), applied in this order.
TEXT_RULES: list[Rule] = [
    (
        "a YAML block scalar under a secret key (`password: |` and the lines indented under it)",
        _lazy(
            r"^(?P<prefix>(?P<indent>[ \t]*)(?P<quote>[\"']?)(?P<name>[A-Za-z0-9_.-]+)(?P=quote)"
            r"[ \t]*:[ \t]*[|>][-+0-9]*[ \t]*\r?\n)"
            r"(?P<value>(?:(?P=indent)[ \t]+[^\r\n]*(?:\r?\n|$))+)",
            re.MULTILINE,
        ),
        _block,
    ),
    (
        "a PEM private key (PKCS#8, RSA, EC, DSA, OPENSSH, ENCRYPTED) or a PGP private key "
        "block, to its END line or, cut short, to the end of its base64",
        _lazy(
            r"(?P<begin>-----BEGIN (?P<kind>[A-Z0-9 ]{0,20})PRIVATE KEY(?P<block>(?: BLOCK)?)-----)"
            r"(?:(?s:.{0,10000}?)(?P<end>-----END (?P=kind)PRIVATE KEY(?P=block)-----)"
            r"|(?:(?:\s|\\[nr])*[A-Za-z0-9+/=]{16,})*)"
        ),
        _pem,
    ),
    (
        "the password of a URL, with or without a user name (redis://:secret@host), up to "
        "its last `@` (postgres://user:p@ss@host hides `p@ss`)",
        _lazy(
            r"(?P<head>(?<![a-z0-9+.-])[a-z][a-z0-9+.-]*://[^:/@\s]*:)"  # a scheme's start
            r"""[^\s/?#'"]+@""",
            re.IGNORECASE,
        ),
        _url_password,
    ),
    (
        "a URL's user name that looks like a token (https://<token>@github.com/...): 20 "
        "characters or more, no password",
        _lazy(
            r"(?P<head>(?<![a-z0-9+.-])[a-z][a-z0-9+.-]*://)[A-Za-z0-9_.~%+-]{20,}@",
            re.IGNORECASE,
        ),
        _url_token,
    ),
    (
        "credentials before a host without a scheme (`app:s3cret@db.internal:5432`)",
        _lazy(
            r"(?P<head>(?<![\w/.:@%+-])(?!(?:mailto|sips?|tel|xmpp|urn|news):)"
            r"[A-Za-z0-9_.%+-]{1,64}:)[^\s:/@'\"]{1,200}@(?=[A-Za-z0-9][A-Za-z0-9.-]*)"
        ),
        _credentials,
    ),
    (
        "a URL-encoded `key%3Dvalue` where the key looks secret (`password%3Dhunter2`)",
        _lazy(rf"(?P<prefix>{_NAME}%3[Dd])(?P<value>[^&\s%]+(?:%(?!26)[0-9A-Fa-f]{{2}}[^&\s%]*)*)"),
        _key_value,
    ),
    (
        "a URL's query parameter that looks secret (`?api_key=`, `&access_token=`, "
        "`?sig=`, `?key=`)",
        _lazy(r"""(?P<prefix>[?&](?P<name>[A-Za-z0-9_.%\[\]-]+)=)(?P<value>[^&#\s'"<>]+)"""),
        _query_value,
    ),
    (
        '`key=value`, `key: value`, `key => value`, `"key": "value"` where the key looks '
        "secret; after `Authorization:`, the credentials that follow the scheme",
        _KEY_VALUE,
        _key_value,
    ),
    (
        "a pair whose first item names a secret: `(password, x)`, `('password', 'x')`, "
        '`["password", "x"]`',
        _lazy(rf"(?P<prefix>[(\[]\s*{_NAME}\s*,\s*{_SCHEME}?)(?P<value>{_VALUE})"),
        _key_value,
    ),
    (
        "a command line's `--password hunter2`",
        _lazy(
            r"(?P<prefix>(?<![\w-])--(?P<name>[A-Za-z][A-Za-z0-9_-]*)[ \t]+)"
            r"(?P<value>[^\s-]\S*)"
        ),
        _key_value,
    ),
    (
        "a secret key's name, a space, then a value of letters and digits (`token S3CRET`)",
        _lazy(
            r"(?P<prefix>(?<![A-Za-z0-9_.-])(?P<quote>)(?P<name>[A-Za-z][A-Za-z0-9_-]{1,40})[ \t]+)"
            r"(?P<value>(?=[^\s,;'\"]*[0-9])(?=[^\s,;'\"]*[A-Za-z])[^\s,;'\"()]{5,})"
        ),
        _key_value,
    ),
    (
        "credentials after an authentication scheme anywhere (`Bearer <token>`)",
        _lazy(rf"(?P<scheme>\b(?:{'|'.join(AUTH_SCHEMES)})\s+)(?!\*\*\*)[^\s,;\"']+"),
        _scheme_credentials,
    ),
    (
        "tokens whose format gives them away without a key name: Stripe secret keys, "
        "GitHub and Slack tokens, AWS access key ids, JWTs",
        _lazy(
            r"\b(?:[sr]k_(?:live|test)_[0-9A-Za-z]+|gh[pousr]_[0-9A-Za-z]{30,}"
            r"|github_pat_[0-9A-Za-z_]{30,}|xox[abposr]-[0-9A-Za-z-]{10,}|AKIA[0-9A-Z]{16}"
            r"|eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*)"
        ),
        _whole,
    ),
]


def redact(value: Any, keys: Iterable[str] | None = None) -> Any:
    """`value` with the values of secret-looking keys replaced by '***', recursively;
    also the second item of a pair whose first names a secret (`["password", "x"]`)."""
    return _redact(value, _keys(keys))


def _redact(value: Any, keys: tuple[str, ...]) -> Any:
    if isinstance(value, dict):
        return {
            key: MASK if isinstance(key, str) and is_secret(key, keys) else _redact(item, keys)
            for key, item in value.items()
        }
    if isinstance(value, (list, tuple)):
        first = value[0] if value else None
        if (
            len(value) == 2
            and isinstance(first, str)
            and _KEY_NAME.fullmatch(first)
            and is_secret(first, keys)
        ):
            return [first, MASK]  # a (name, value) pair: `["password", "x"]`
        return [_redact(item, keys) for item in value]
    if isinstance(value, str):
        return _redact_text(value, keys)
    return value


#: What the first item of a (name, value) pair looks like: a header's or a field's name.
_KEY_NAME = _lazy(r"[A-Za-z0-9_.-]{1,80}")


def redact_call(
    args: Any, kwargs: Any, names: Sequence[str] = (), keys: Iterable[str] | None = None
) -> dict[str, Any]:
    """A job's call as shown: `redact` of its arguments, and each positional argument
    whose parameter (`names`, in order; a last `*name` for a variadic one) looks secret
    masked whole, as the same value passed by keyword is: `call_partner(url, "p@ssw0rd")`
    shows `["url", "***"]`."""
    secrets = _keys(keys)
    shown = _redact({"args": args, "kwargs": kwargs}, secrets)
    if isinstance(args, list) and names:
        # A last name `*rest` is a variadic parameter's: it names every argument past it.
        rest = names[-1][1:] if names[-1].startswith("*") else None
        named = names[:-1] if rest is not None else names

        def name_of(index: int) -> str | None:
            return named[index] if index < len(named) else rest

        shown["args"] = [
            MASK if (name := name_of(index)) is not None and is_secret(name, secrets) else item
            for index, item in enumerate(shown["args"])
        ]
    return cast("dict[str, Any]", shown)


def redact_text(text: str, keys: Iterable[str] | None = None) -> str:
    """`text` with every form in TEXT_RULES masked."""
    return _redact_text(text, _keys(keys))


def _redact_text(text: str, keys: tuple[str, ...]) -> str:
    for _, pattern, replace in TEXT_RULES:
        text = _apply(pattern, replace, text, keys)
    return text


def _apply(pattern: re.Pattern[str], replace: Replace, text: str, keys: tuple[str, ...]) -> str:
    """`pattern.sub`, except that a match `replace` leaves (None) is scanned again from
    its value, so `url: https://h/?token=x` or `charge:token=x` still mask the token."""
    out, position = [], 0
    while (match := pattern.search(text, position)) is not None:
        out.append(text[position : match.start()])
        replaced = replace(match, keys)
        if replaced is not None:
            out.append(replaced[0])
            position = max(replaced[1], match.start() + 1)
        else:
            position = max(match.start("value"), match.start() + 1)
            out.append(text[match.start() : position])
    out.append(text[position:])
    return "".join(out)


#: A unique key's runs between separators, and what in a run may be a token: a part
#: (between `-` and `_`) of 8 or more characters that mixes letters and digits, or of 16
#: or more of any kind (a reset token, a session id, a digest, a UUID, a card number).
_KEY_RUN = _lazy(r"[^\s:/|,;.=@]+")
_TOKEN_PART = _lazy(
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
