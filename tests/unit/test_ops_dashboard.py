"""The example Grafana dashboard asks only for metrics the services define, and docs/metrics.md
names every one of them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import REGISTRY

import bc_command_queue.metrics
import bc_engine.metrics
import bc_pki.metrics
import bc_secrets.metrics
import bc_site_agent.metrics

ROOT = Path(__file__).resolve().parents[2]
MODULES = (
    bc_engine.metrics,
    bc_command_queue.metrics,
    bc_pki.metrics,
    bc_secrets.metrics,
    bc_site_agent.metrics,
)


def _defined() -> set[str]:
    assert MODULES
    names: set[str] = set()
    for family in REGISTRY.collect():
        if family.name.startswith("bc_"):
            names.add(family.name)
            names.update(s.name for s in family.samples)
            suffix = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}.get(family.type, ())
            names.update(family.name + x for x in suffix)
    return names


def test_the_dashboard_asks_for_defined_metrics_only() -> None:
    dashboard = json.loads((ROOT / "deploy/grafana/better-compute.json").read_text())
    asked = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\b(bc_[a-z_]+)", target["expr"])
    }
    assert asked, "the dashboard has no bc_ metric"
    assert asked <= _defined(), sorted(asked - _defined())


def test_docs_name_every_metric_with_no_id_labels() -> None:
    doc = (ROOT / "docs/metrics.md").read_text()
    for family in REGISTRY.collect():
        if not family.name.startswith("bc_"):
            continue
        shown = family.name + ("_total" if family.type == "counter" else "")
        assert f"`{shown}`" in doc, shown
    for module in MODULES:
        for value in vars(module).values():
            labels = getattr(value, "_labelnames", ())
            assert not {"node", "node_id", "workflow", "workflow_id", "command_id", "agent_id"} & set(labels)
