"""docs/METRICS.md lists exactly the metric names, types and labels the code exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import Counter, Histogram

from genserver import metrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "METRICS.md"
ROW = re.compile(r"^\| `(genserver_\w+)` \| (\w+) \|([^|]*)\|", re.MULTILINE)


def documented() -> dict[str, tuple[str, frozenset[str]]]:
    rows = ROW.findall(DOC.read_text())
    table = {name: (kind, frozenset(re.findall(r"`(\w+)`", labels))) for name, kind, labels in rows}
    assert len(table) == len(rows), "a metric is listed twice in docs/METRICS.md"
    return table


def exposed_name(name: str, kind: str) -> str:
    return f"{name}_total" if kind == "counter" else name


@pytest.mark.django_db
def test_the_doc_lists_exactly_the_exported_metrics():
    exported = {}
    for metric in vars(metrics).values():  # counted where it happens
        if isinstance(metric, Counter | Histogram):
            exported[exposed_name(metric._name, metric._type)] = (metric._type, frozenset(metric._labelnames))
    for family in metrics.ClusterCollector().collect():  # read at scrape time
        labels = frozenset(family._labelnames) if hasattr(family, "_labelnames") else frozenset()
        exported[exposed_name(family.name, family.type)] = (family.type, labels)
    assert documented() == exported


def test_the_grafana_dashboard_queries_only_documented_metrics():
    dashboard = json.loads((DOC.parent / "grafana-dashboard.json").read_text())
    queried = {
        re.sub(r"_(bucket|sum|count)$", "", name)
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\bgenserver_\w+", target["expr"])
    }
    assert queried and queried <= set(documented())
    titles = " ".join(panel["title"] for panel in dashboard["panels"])
    for shown in ("backlog", "Wait P50 / P99", "refused", "Step time", "cards"):
        assert shown.lower() in titles.lower() or any(
            shown in t["legendFormat"] for p in dashboard["panels"] for t in p["targets"]
        ), shown
