"""The package's layers: imports flow one way, from commands down to `states.py`.

Module-level imports of the package must form no cycle. A function-local import of the
package is allowed only in the modules that may be imported before Django's app
registry is ready (they must not import models at import time), and in `apps.ready()`;
and anywhere, of a module that imports an optional extra (OPTIONAL_EXTRAS).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "django_skipqueue"

#: Imported by user code at import time (`@task`, settings, the django.tasks backend, test
#: helpers in a conftest), possibly before the app registry is ready; and the app config.
BEFORE_THE_REGISTRY = {
    "django_skipqueue",
    "django_skipqueue.apps",
    "django_skipqueue.tasks.base",
    "django_skipqueue.tasks.context",  # TaskContext, imported by the package root
    "django_skipqueue.tasks.options",
    "django_skipqueue.tasks.canvas",  # chain/group/chord: imported by the package root
    "django_skipqueue.backends",
    "django_skipqueue.tasks.registry",
    "django_skipqueue.testing",
    # A redelivered relay job's child process imports it to find its function, before
    # it sets Django up (broker/isolation.py).
    "django_skipqueue.broker.isolation",
}


#: Modules that import an optional extra at their top (prometheus_client): imported
#: inside the function that needs them, so that nothing else imports the extra. And
#: the broker layer's modules that the rabbitmq extra's modes use (pika, relayed
#: queues): imported by those modes only, so that a plain worker starts without them
#: and a check or the admin imports them only where queues are relayed.
OPTIONAL_EXTRAS = {
    "django_skipqueue.runtime.prometheus",
    "django_skipqueue.broker.consumer",
    "django_skipqueue.broker.relay",
    "django_skipqueue.broker.topology",
}


def modules() -> dict[str, ast.Module]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if "migrations" in path.parts:
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text())
    return found


def imported(node: ast.Import | ast.ImportFrom, names: set[str]) -> set[str]:
    """The package's modules that an import statement imports."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in names}
    base = node.module or ""
    if base not in names:
        return set()
    found = {f"{base}.{alias.name}" for alias in node.names} & names
    return found or {base}


def is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def module_level_imports(tree: ast.Module, names: set[str]) -> set[str]:
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= imported(node, names)
        elif isinstance(node, ast.If) and not is_type_checking(node):
            for child in node.body + node.orelse:
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    found |= imported(child, names)
        elif isinstance(node, ast.Try):
            for child in node.body:
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    found |= imported(child, names)
    return found


def function_local_imports(tree: ast.Module, names: set[str]) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for child in ast.walk(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    found |= imported(child, names)
    return found


def graph() -> dict[str, set[str]]:
    trees = modules()
    names = set(trees)
    return {name: module_level_imports(tree, names) - {name} for name, tree in trees.items()}


def test_module_level_imports_of_the_package_form_no_cycle():
    edges = graph()
    cycles: list[list[str]] = []
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for target in sorted(edges.get(name, ())):
            if state.get(target) == "open":
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[name] = "done"

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_states_is_a_leaf():
    assert graph()["django_skipqueue.core.states"] <= {
        "django_skipqueue.exceptions",
        "django_skipqueue.conf.validators",  # the queue-name rule, shared with the settings
    }


def test_the_layers_contract_holds():
    """The import-linter contracts of pyproject.toml (docs/explanation/architecture.md):
    imports go down only, in functions and under TYPE_CHECKING too; pika only in broker/."""
    import subprocess
    import sys

    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run(
        [str(lint), "--no-cache"], cwd=PACKAGE.parent, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert "0 broken" in done.stdout


def test_no_import_cycle_of_any_kind_but_models_and_their_managers():
    """Function-level and TYPE_CHECKING imports count too (grimp's graph)."""
    import grimp

    graph = grimp.build_graph("django_skipqueue")
    modules = {m for m in graph.modules if ".migrations" not in m}
    pairs = sorted(
        (a, b)
        for a in modules
        for b in graph.find_modules_directly_imported_by(a)
        if b in modules and a < b and graph.direct_import_exists(importer=b, imported=a)
    )
    assert pairs == [("django_skipqueue.models", "django_skipqueue.queue.managers")]


def test_function_local_imports_only_where_the_app_registry_requires_them():
    trees = modules()
    names = set(trees)
    offenders = {
        name: sorted(local)
        for name, tree in trees.items()
        if name not in BEFORE_THE_REGISTRY
        and (local := function_local_imports(tree, names) - {name} - OPTIONAL_EXTRAS)
    }
    assert offenders == {}


def test_a_plain_worker_starts_without_the_broker_layer_or_opentelemetry():
    """What a worker of a project without relayed queues imports before its first job
    (setup, the checks, the command, a job run): not the broker layer, and not
    OpenTelemetry (core/tracing.py) while nothing traced. A relayed project's check
    still imports it (and finds pika)."""
    code = (
        "import sys, django; django.setup()\n"
        "from django.core.management import call_command\n"
        "call_command('check', verbosity=0)\n"
        "import django_skipqueue.management.commands.runworker\n"
        "from django_skipqueue.core import tracing\n"
        "from django_skipqueue.models import Job\n"
        "tracing.start_run(Job(id=1, task='t', queue_name='q', attempts=1))\n"
        "print('loaded', sorted(m for m in sys.modules\n"
        "      if m.startswith(('django_skipqueue.broker', 'opentelemetry', 'pika'))))\n"
        "from django.conf import settings\n"
        "relay = {'URL': 'amqp://127.0.0.1', 'QUEUES': ['mail']}\n"
        "settings.SKIPQUEUE = {**settings.SKIPQUEUE, 'RELAY': relay}\n"
        "call_command('check', verbosity=0)\n"
        "print('pika', 'pika' in sys.modules)\n"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stdout.splitlines() if line.startswith(("loaded", "pika"))]
    assert said == ["loaded []", "pika True"]


def test_a_project_without_schedules_never_imports_croniter():
    """croniter (and dateutil with it) is imported when a schedule first needs it
    (core/cron.py): a worker of a project without schedules starts without it."""
    code = (
        "import sys, django; django.setup()\n"
        "import django_skipqueue.management.commands.runworker\n"
        "from django_skipqueue import Cron\n"
        "print('croniter' in sys.modules, end=' ')\n"
        "Cron('0 3 * * *')\n"
        "print('croniter' in sys.modules)\n"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["False", "True"]
