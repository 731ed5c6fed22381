"""Side by side: the key numbers of several ``benchmarks.e2e --out FILE.json`` runs.

    uv run python -m benchmarks.compare before.json after.json [...]

Standard library only. One column per file, named by the file's stem.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _get(data: dict[str, Any], *path: str) -> Any:
    cur: Any = data
    for key in path:
        if not isinstance(cur, dict) or key not in cur:
            return None
        cur = cur[key]
    return cur


def _cpu_per_job(data: dict[str, Any], phase: str, process: str) -> float | None:
    used = _get(data, "cpu_seconds", phase, process)
    jobs = _get(data, "args", "jobs")
    if used is None or not jobs:
        return None
    return 1000.0 * float(used) / float(jobs)


ROWS: list[tuple[str, Any]] = [
    ("code", lambda d: str(d.get("source", "?")).replace(" (frozen copy)", "")),
    ("load avg during the burst", lambda d: _get(d, "cpu_seconds", "pipeline", "load")),
    ("→ HANDED_OFF jobs/s", lambda d: _get(d, "throughput", "handed_off")),
    ("→ SUCCEEDED jobs/s", lambda d: _get(d, "throughput", "succeeded")),
    ("→ closed jobs/s", lambda d: _get(d, "throughput", "closed")),
    ("ceiling jobs/s (mean of a, b)", lambda d: _get(d, "throughput", "ceiling_mean")),
    ("ratio pipeline/ceiling", lambda d: _get(d, "throughput", "ratio")),
    (
        "light submit→placed p50 ms",
        lambda d: _get(d, "latency_ms", "light: submit→placed (queued GPU)", "p50"),
    ),
    (
        "light submit→handed off p50 ms",
        lambda d: _get(d, "latency_ms", "light: submit→handed off (all)", "p50"),
    ),
    (
        "light submit→handed off p99 ms",
        lambda d: _get(d, "latency_ms", "light: submit→handed off (all)", "p99"),
    ),
    (
        "burst submit→handed off p50 ms",
        lambda d: _get(d, "latency_ms", "burst: submit→handed off (queued GPU)", "p50"),
    ),
    (
        "cancel→terminated on peer p50 ms",
        lambda d: _get(d, "latency_ms", "cancel (one at a time) → terminated on peer", "p50"),
    ),
    ("worker CPU ms/job (burst)", lambda d: _cpu_per_job(d, "pipeline", "iris worker")),
    ("server CPU ms/job (burst)", lambda d: _cpu_per_job(d, "pipeline", "temporal server")),
    ("server CPU ms/job (ceiling a)", lambda d: _cpu_per_job(d, "ceiling a", "temporal server")),
    ("events per GPU job", lambda d: _get(d, "history_per_job", "pipeline gpu", "events")),
    ("workflow tasks per GPU job", lambda d: _get(d, "history_per_job", "pipeline gpu", "workflow tasks")),
    ("RPCs per GPU job", lambda d: _get(d, "history_per_job", "pipeline gpu", "round trips")),
]


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 100 else f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def main() -> None:
    files = [Path(a) for a in sys.argv[1:]]
    if not files:
        sys.exit(__doc__)
    data = [json.loads(f.read_text()) for f in files]
    headers = ["", *(f.stem for f in files)]
    rows = [[label, *(_fmt(get(d)) for d in data)] for label, get in ROWS]
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    for r in [headers, *rows]:
        print(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )


if __name__ == "__main__":
    main()
