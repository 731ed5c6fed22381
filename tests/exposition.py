"""A Prometheus text exposition as a dict of samples (tests/metrics, tests/placement)."""

from __future__ import annotations

import re

# Labels the Temporal SDK's meter adds to every Iris metric; the tests look past them.
METER_LABELS = {"namespace", "task_queue", "activity_type", "service_name"}
Series = dict[tuple[str, frozenset[tuple[str, str]]], float]
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def exposition(text: str) -> Series:
    """Every sample of a Prometheus text exposition under the name it is exported with (as the
    Prometheus server stores it), without the meter's own labels."""
    out: Series = {}
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        name, body, value = match.groups()
        labels = frozenset((k, v) for k, v in LABEL.findall(body or "") if k not in METER_LABELS)
        out[(name, labels)] = float(value)
    return out
