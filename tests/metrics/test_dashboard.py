"""The Grafana dashboard (deploy/grafana/iris-federation.json) queries only metrics that exist: Iris's
own, as iris/metrics.py names them, the Temporal SDK's (``temporal_*``) and Prometheus's ``up``; and
it shows every iris_* metric (tests/e2e/test_metrics.py runs each query on a real Prometheus)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from dashboard import DASHBOARD, dashboard_metric_names, expressions, metric_names, panels

from iris import metrics

HISTOGRAM_SERIES = {h + suffix for h in metrics.HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}
KNOWN = set(metrics.ALL_NAMES) | HISTOGRAM_SERIES | {"up"}


def unknown_names(dashboard: dict[str, Any]) -> list[str]:
    return sorted(
        n for n in dashboard_metric_names(dashboard) if n not in KNOWN and not n.startswith("temporal_")
    )


@pytest.fixture(scope="module")
def board() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def test_every_query_names_only_known_metrics(board: dict[str, Any]) -> None:
    assert expressions(board)
    assert unknown_names(board) == []


def test_every_iris_metric_is_on_the_dashboard(board: dict[str, Any]) -> None:
    shown = {n.removesuffix("_bucket") for n in dashboard_metric_names(board)}
    assert sorted(set(metrics.ALL_NAMES) - shown) == []


def test_a_query_of_a_metric_that_does_not_exist_is_caught(board: dict[str, Any]) -> None:
    broken = copy.deepcopy(board)
    target = next(p for p in panels(broken) if p.get("targets"))["targets"][0]
    target["expr"] = (
        'sum by (peer) (rate(iris_handoffs_total{outcome="ok"}[5m]))'  # the name is iris_handoffs
    )
    assert unknown_names(broken) == ["iris_handoffs_total"]


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (le, peer) (rate(iris_x_bucket{peer=~"a|b"}[5m]))', {"iris_x_bucket"}),
        (
            "histogram_quantile(0.95, sum by (le) (rate(a_bucket[15m]))) > 0.5 and on (job) up",
            {"a_bucket", "up"},
        ),
        ('max without (instance) (x) / ignoring (le) y{route="/v1/jobs/{job_id:path}"} * 60', {"x", "y"}),
    ],
)
def test_metric_names_leave_out_labels_functions_and_durations(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_every_panel_reads_the_chosen_prometheus(board: dict[str, Any]) -> None:
    assert board["uid"] and board["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    for panel in panels(board):
        if panel.get("type") == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
