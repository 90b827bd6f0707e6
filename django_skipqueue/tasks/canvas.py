"""Workflows as code: signatures, chain, group and chord (docs/howto/workflows.md).

The names are Celery's, so that code written for Celery reads the same:

    chain(fetch.s(url), parse.s(), store.s()).enqueue()
    chord(group(resize.s(i) for i in images), publish.s()).enqueue()
    chain(a.s(), group(b.s(), c.s()), d.s())   # d receives [b's result, c's result]

A signature is a task and a call (`task.s(*args, **kwargs)`); `.si()` makes one that
does not receive its parent's result. `.enqueue()` turns the whole structure into a
plan (each signature one job, each job knowing its parents and whose results it
receives) and hands it to the queue layer, which writes it in the caller's transaction
and returns the `Workflow` row as the handle. Pure until then: nothing here touches the
database.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeAlias

from django_skipqueue.conf import get_settings
from django_skipqueue.core.spec import JobSpec
from django_skipqueue.exceptions import InvalidJobError
from django_skipqueue.queue.workflows import Plan, PlannedJob, Tree
from django_skipqueue.tasks.base import Signature, Task

if TYPE_CHECKING:
    from django_skipqueue.models import Workflow

#: Anything that can be a step of a chain, a member of a group, or a chord's part.
Canvas: TypeAlias = "Signature | chain | group | chord"


class _Composite:
    def enqueue(self, *, on_error: Signature | None = None) -> Workflow:
        """Write every job of this workflow in the caller's transaction; the handle.

        `on_error` runs once if any job of the workflow ends failed (its attempts spent)
        or cancelled, receiving the failed job's id and its error before its own
        arguments. Rolled back with the caller's transaction: then nothing exists.
        """
        from django_skipqueue.models import Workflow  # the app registry is ready by now

        streamed = _streamed(self, on_error)  # type: ignore[arg-type]
        if streamed is not None:
            return streamed
        plan, database = plan_of(self, on_error)  # type: ignore[arg-type]
        return Workflow.objects.db_manager(database).start(plan)


class chain(_Composite):  # noqa: N801  (Celery's name)
    """Steps run one after another; each receives the previous step's result."""

    def __init__(self, *steps: Canvas) -> None:
        if not steps:
            raise InvalidJobError("chain() needs at least one step")
        self.steps = tuple(_checked(step, "a step of chain()") for step in steps)

    def __repr__(self) -> str:
        return f"chain({', '.join(map(repr, self.steps))})"


class group(_Composite):  # noqa: N801  (Celery's name)
    """Members run in parallel; the group's result is the list of theirs, in order.

    `group(a.s(), b.s())`, or `group(iterable)` for a fan-out built in a loop. A group of
    an iterator (a generator) of signatures, enqueued as the whole workflow or as a
    chord's header, is read one batch at a time: memory stays bounded however many
    members it yields. Like the generator, it can be enqueued once.
    """

    def __init__(self, *members: Canvas | Iterable[Canvas]) -> None:
        self._source: Iterator[Any] | None = None
        self._members: tuple[Canvas, ...] | None = None
        if len(members) == 1 and not isinstance(members[0], (Signature, _Composite)):
            given = members[0]
            if isinstance(given, Iterator):
                self._source = given
                return
            members = tuple(given)
        self._members = tuple(_checked(member, "a member of group()") for member in members)

    @property
    def members(self) -> tuple[Canvas, ...]:
        if self._members is None:
            source, self._source = self._source, None
            self._members = tuple(
                _checked(member, "a member of group()") for member in source or ()
            )
        return self._members

    def streamable(self) -> Iterator[Signature] | None:
        """The members, read as they come, if this group was given an iterator whose
        first member is a signature (the rest are checked as read); None if it holds its
        members already, or if they are chains, groups or chords (then read at once)."""
        if self._source is None:
            return None
        source, self._source = self._source, None
        first = next(source, None)
        if first is not None and not isinstance(first, Signature):
            self._members = tuple(
                _checked(member, "a member of group()")
                for member in itertools.chain([first], source)
            )
            return None
        self._members = ()
        given = itertools.chain([first], source) if first is not None else source
        return (_signature_member(member) for member in given)

    def __repr__(self) -> str:
        if self._members is None:
            return "group(<iterator>)"
        return f"group({len(self.members)} members)"


class chord(_Composite):  # noqa: N801  (Celery's name)
    """A group, then `body` once, receiving the list of the group's results."""

    def __init__(self, header: group | Iterable[Canvas], body: Canvas) -> None:
        self.header = header if isinstance(header, group) else group(header)
        self.body = _checked(body, "the body of chord()")

    def __repr__(self) -> str:
        return f"chord({self.header!r}, {self.body!r})"


def _signature_member(item: Any) -> Signature:
    if isinstance(item, Signature):
        return item
    if isinstance(item, _Composite):
        raise InvalidJobError(
            f"a group read from a generator whose first member is a signature holds "
            f"signatures only (it is written batch by batch), got {item!r}: make the "
            f"generator yield one kind, or pass a list"
        )
    _checked(item, "a member of group()")
    raise AssertionError  # _checked raised


def _checked(item: Any, where: str) -> Canvas:
    if isinstance(item, (Signature, _Composite)):
        return item  # type: ignore[return-value]
    hint = " (call .s() on a task to make one)" if hasattr(item, "spec") else ""
    raise InvalidJobError(f"{where} must be a signature, chain, group or chord, got {item!r}{hint}")


# -- the plan ---------------------------------------------------------------------------

#: What a step receives from upstream: its parents (positions) and whose results form
#: its first argument.
Upstream: TypeAlias = "tuple[tuple[int, ...], Tree] | None"


class _Planner:
    def __init__(self) -> None:
        self.jobs: list[PlannedJob] = []
        self.databases: set[str] = set()

    def place(self, node: Canvas, upstream: Upstream) -> tuple[tuple[int, ...], Tree]:
        """Add the jobs of `node` after `upstream`: (its output positions, its result tree)."""
        if isinstance(node, Signature):
            return self._signature(node, upstream)
        if isinstance(node, chain):
            outs: tuple[int, ...] = ()
            tree: Tree = []
            for step in node.steps:
                outs, tree = self.place(step, upstream)
                upstream = (outs, tree)
            return outs, tree
        if isinstance(node, group):
            outs, trees = (), []
            for member in node.members:
                member_outs, member_tree = self.place(member, upstream)
                outs += member_outs
                trees.append(member_tree)
            return outs, trees
        if isinstance(node, chord):
            return self.place(node.body, self.place(node.header, upstream))
        raise InvalidJobError(f"not a workflow step: {node!r}")

    def _signature(self, signature: Signature, upstream: Upstream) -> tuple[tuple[int, ...], Tree]:
        self.databases.add(signature.task.get_database())
        self.jobs.append(_planned(signature, upstream))
        position = len(self.jobs) - 1
        return (position,), position


def _streamed(root: Canvas, on_error: Signature | None) -> Workflow | None:
    """A group of an iterator, alone or as a chord's header (with a signature as the
    body), written batch by batch (`WorkflowManager.start_streamed`); None otherwise."""
    header = root.header if isinstance(root, chord) else root
    if not isinstance(header, group) or header._members is not None:
        return None
    body: Signature | None = None
    if isinstance(root, chord):
        if not isinstance(root.body, Signature):
            return None
        body = root.body
    source = header.streamable()
    if source is None:
        return None
    from django_skipqueue.models import Workflow

    extras = [sig for sig in (body, on_error) if sig is not None]
    database = extras[0].task.get_database() if extras else get_settings().DATABASE_ALIAS
    names: list[str] = []
    count = 0

    specs: dict[int, tuple[Task[Any, Any], JobSpec]] = {}  # one spec per task object

    def members() -> Iterator[PlannedJob]:
        nonlocal count
        for signature in source:
            count += 1
            task = signature.task
            known = specs.get(id(task))
            if known is None or known[0] is not task:  # checked once per task object
                if task.get_database() != database:
                    raise InvalidJobError(
                        f"a workflow's jobs must share one database; {task.name} uses "
                        f"{task.get_database()!r}, not {database!r}"
                    )
                known = specs[id(task)] = (task, task.enqueue_spec())
            if len(names) < 2 and _name(signature) not in names:
                names.append(_name(signature))
            yield PlannedJob(
                spec=known[1],
                args=tuple(signature.args),
                kwargs=dict(signature.kwargs),
                output=body is None,
            )

    def named() -> str:
        kinds = names[0] if len(names) == 1 else "members"
        header_name = f"group({count} x {kinds})"
        return f"chord({header_name}, {_name(body)})" if body else header_name

    body_job = None
    if body is not None:
        body_job = dataclasses.replace(
            _planned(body, None), inputs=None if body.immutable else [], output=True
        )
    if on_error is not None and not isinstance(on_error, Signature):
        raise InvalidJobError(f"on_error must be a signature (task.s(...)), got {on_error!r}")
    handler = dataclasses.replace(_planned(on_error, None), on_error=True) if on_error else None
    return Workflow.objects.db_manager(database).start_streamed(
        "group(<members>)", members(), body=body_job, on_error=handler, named=named
    )


def _planned(signature: Signature, upstream: Upstream) -> PlannedJob:
    parents, inputs = upstream if upstream is not None else ((), None)
    return PlannedJob(
        spec=signature.task.enqueue_spec(),
        args=tuple(signature.args),
        kwargs=dict(signature.kwargs),
        parents=tuple(parents),
        inputs=None if signature.immutable or upstream is None else inputs,
    )


def plan_of(root: Canvas, on_error: Signature | None = None) -> tuple[Plan, str]:
    """The jobs of `root` (parents before dependents) and the database they go to."""
    planner = _Planner()
    outs, tree = planner.place(root, None)
    jobs = [
        dataclasses.replace(job, output=True) if position in outs else job
        for position, job in enumerate(planner.jobs)
    ]
    if on_error is not None:
        if not isinstance(on_error, Signature):
            raise InvalidJobError(f"on_error must be a signature (task.s(...)), got {on_error!r}")
        planner.databases.add(on_error.task.get_database())
        jobs.append(
            PlannedJob(
                spec=on_error.task.enqueue_spec(),
                args=tuple(on_error.args),
                kwargs=dict(on_error.kwargs),
                on_error=True,
            )
        )
    if len(planner.databases) > 1:
        raise InvalidJobError(
            f"a workflow's jobs must share one database; these use {sorted(planner.databases)}"
        )
    database = planner.databases.pop() if planner.databases else _default_database()
    return Plan(name=_name(root)[:255], jobs=tuple(jobs), output=tree), database


def _default_database() -> str:
    return get_settings().DATABASE_ALIAS


def _name(node: Canvas) -> str:
    """A short description for the admin: chain(a, group(3 x b), c)."""
    if isinstance(node, Signature):
        return node.task.name.rsplit(".", 1)[-1]
    if isinstance(node, chain):
        return f"chain({', '.join(_name(step) for step in node.steps)})"
    if isinstance(node, group):
        names = [_name(member) for member in node.members]
        if len(set(names)) == 1 and len(names) > 2:
            return f"group({len(names)} x {names[0]})"
        return f"group({', '.join(names)})"
    return f"chord({_name(node.header)}, {_name(node.body)})"
