"""What the queue layer needs of a task: the port between `tasks/` and `queue/`.

The managers take any object with these attributes (structurally: `tasks.base.Task`
is one), so that the queue layer never imports the task API above it
(docs/explanation/architecture.md, "The rules").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Protocol


class JobSpec(Protocol):
    """A task's resolved options, its call rules and its key rules, as enqueue uses them."""

    @property
    def name(self) -> str: ...
    @property
    def queue_name(self) -> str: ...
    @property
    def priority(self) -> int: ...
    @property
    def run_after(self) -> datetime | timedelta | None: ...
    @property
    def unique_key(self) -> object | None: ...
    @property
    def on_conflict(self) -> str: ...
    @property
    def concurrency_key(self) -> object | None: ...
    @property
    def concurrency_limit(self) -> int: ...
    @property
    def resolved_max_attempts(self) -> int: ...
    @property
    def resolved_lease(self) -> timedelta: ...

    def check_call(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Refuse (InvalidJobError) a call that does not bind to the task's signature."""

    def check_limits(self, adding: int) -> None:
        """Refuse enqueueing `adding` jobs past the volume guards."""

    def key_for(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The unique key of one call."""

    def concurrency_key_for(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The concurrency key of one call."""
