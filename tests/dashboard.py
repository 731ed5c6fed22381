"""The Grafana dashboard under deploy/grafana/ as the tests read it: its PromQL and the metric names
it uses (tests/metrics/test_dashboard.py checks them against iris/metrics.py, tests/e2e/test_metrics.py
against a real Prometheus)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "iris-federation.json"

# PromQL words that are not metric names.
_KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_RANGE = re.compile(r"\[[^\]]*\]")
_NAME = re.compile(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()")


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside rows too."""
    found = []
    for panel in dashboard.get("panels", []):
        found.append(panel)
        found += panel.get("panels", [])
    return found


def expressions(dashboard: dict[str, Any] | None = None) -> list[str]:
    """The PromQL of every panel's queries."""
    board = dashboard if dashboard is not None else json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in panels(board) for t in p.get("targets", []) if t.get("expr")]


def metric_names(expr: str) -> set[str]:
    """The metric names one PromQL expression selects (label names, functions, keywords and
    durations left out)."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub("", text)
    text = _GROUPING.sub("", text)
    text = _RANGE.sub("", text)
    return {n for n in _NAME.findall(text) if n not in _KEYWORDS and not re.fullmatch(r"\d.*", n)}


def dashboard_metric_names(dashboard: dict[str, Any] | None = None) -> set[str]:
    names: set[str] = set()
    for expr in expressions(dashboard):
        names |= metric_names(expr)
    return names
