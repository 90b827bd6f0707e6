"""Python's cyclic garbage collector during a worker's start-up.

A worker's start-up imports Django, the project's apps, psycopg and this app: hundreds
of thousands of objects, none of them garbage. While they are made, the collector runs
again and again, and each full collection walks all of them: 43 collections and 24 ms
of a `runworker --burst` start-up, measured from this package's import to the command's
(benchmarks/RESULTS.md, twenty-second pass), the first job of a drain or of a pod
scaled from zero waiting for it.

So a `runworker` process (the management command's name is its first argument) turns
the collector off when this package is imported, and the command turns it on again as
it starts (`resume`): what start-up made is frozen first (`gc.freeze`, into the
permanent generation), so that no later collection walks it again, and the children a
`--processes` worker forks share those pages instead of copying them when a
collection touches them (the way Python's documentation of `gc.freeze` describes).
Any other process, and a worker started from code (`Worker(...).run()`), is untouched.
"""

from __future__ import annotations

import gc
import sys

_paused = False


def pause_for_worker_start(argv: list[str] | None = None) -> None:
    """Turn the collector off if this process is `manage.py runworker` (or
    `django-admin runworker`, `python -m django runworker`) and it is on."""
    global _paused
    args = sys.argv if argv is None else argv
    if args[1:2] == ["runworker"] and gc.isenabled():
        gc.disable()
        _paused = True


def resume() -> None:
    """Freeze what start-up made, then turn the collector on again (if it was paused)."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()
