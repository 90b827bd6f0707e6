"""Fault tests (docs/explanation/failure-model.md): real processes, real faults.

Marked `chaos`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.harness import Supervisor


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents and not item.get_closest_marker("soak"):
            item.add_marker(pytest.mark.chaos)


@pytest.fixture
def supervisor(tmp_path: Path):
    supervisor = Supervisor(tmp_path)
    yield supervisor
    supervisor.stop_all()
