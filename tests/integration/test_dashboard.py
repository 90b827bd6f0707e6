"""The Grafana dashboard in docs/ uses exactly the series the code exposes (issue 28)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from django_skipqueue.runtime.prometheus import PrometheusSeries, QueueSample, gauge_families
from django_skipqueue.runtime.runner import Outcome

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "django-skipqueue.json"
GUIDE = Path(__file__).resolve().parents[2] / "docs" / "howto" / "metrics-and-traces.md"


def exposed() -> set[str]:
    """Every series name the workers and the web view expose (without suffixes)."""
    registry = CollectorRegistry()
    PrometheusSeries(registry)
    names = {family.name for family in registry.collect()}
    names |= {family.name for family in gauge_families(QueueSample())}
    return names


def base(name: str) -> str:
    return re.sub(r"_(total|bucket|count|sum)$", "", name)


def test_the_dashboard_uses_every_series_and_no_other():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    used = {base(name) for expr in exprs for name in re.findall(r"skipqueue_[a-z_]+", expr)}
    assert used == exposed()


def test_the_guide_documents_every_series():
    guide = GUIDE.read_text()
    for name in exposed():
        shown = (
            f"{name}_total"
            if name in {"skipqueue_jobs_finished", "skipqueue_lease_expirations", "skipqueue_steps"}
            else name
        )
        assert f"`{shown}`" in guide, name


def test_the_dashboard_filters_on_outcomes_that_exist():
    """Its "refused by the fence" panel filtered on outcome="refused", which no worker
    counts (the fence's refusals are `lost`): a panel that never showed anything."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    named = {
        value
        for expr in exprs
        for values in re.findall(r'outcome=~?"([^"]+)"', expr)
        for value in values.split("|")
    }
    assert named and named <= {outcome.value for outcome in Outcome}
