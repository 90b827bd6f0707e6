"""What the management commands share: argparse `type=` functions and logging setup."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_skipqueue.core.states import validate_queue_name
from django_skipqueue.exceptions import InvalidJobError

logger = logging.getLogger("django_skipqueue")
LOG_LEVELS = {0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG, 3: logging.DEBUG}


def _whole_number(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(
            f"{value} is not positive" if minimum else f"{value} is negative"
        )
    return value


def positive_int(text: str) -> int:
    return _whole_number(text, 1)


def zero_or_more_int(text: str) -> int:
    return _whole_number(text, 0)


def port_number(text: str) -> int:
    value = _whole_number(text, 1)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (1 to 65535)")
    return value


def _number(text: str, unit: str, *, allow_zero: bool) -> float:
    """A finite number of `unit`: positive, or zero or more with `allow_zero`."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of {unit}") from None
    if not (value >= 0 if allow_zero else value > 0) or value == float("inf"):
        kind = "zero or more" if allow_zero else "more than zero"
        raise argparse.ArgumentTypeError(f"{text!r} must be {kind} {unit}")
    return value


def seconds(text: str) -> float:
    return _number(text, "seconds", allow_zero=True)


def positive_seconds(text: str) -> float:
    return _number(text, "seconds", allow_zero=False)


def megabytes(text: str) -> float:
    return _number(text, "megabytes", allow_zero=False)


def queue_name(text: str) -> str:
    try:
        return validate_queue_name(text)
    except InvalidJobError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def configure_logging(command: BaseCommand, verbosity: int) -> None:
    """Map --verbosity to our loggers' level; log to stdout unless a handler exists."""
    logger.setLevel(LOG_LEVELS.get(verbosity, logging.INFO))
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(command.stdout)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(handler)


def typed_options(parser: CommandParser, options: dict[str, Any]) -> dict[str, Any]:
    """`options` with each value given as text to `call_command()` put through its
    option's `type`, as the command line's are. Django's call_command() passes keyword
    options as given: `call_command("reapjobs", prune_done_older_than="7d")` reached
    the database as "7d" and raised a raw DataError. A bad value is a CommandError."""
    typed = dict(options)
    for action in parser._actions:  # argparse's list of options, as call_command reads it
        value = typed.get(action.dest)
        if not isinstance(value, str) or action.type is None or action.type is str:
            continue
        try:
            typed[action.dest] = action.type(value)  # type: ignore[operator]
        except (argparse.ArgumentTypeError, ValueError) as error:
            raise CommandError(f"{action.option_strings[0]}: {error}") from error
    return typed
