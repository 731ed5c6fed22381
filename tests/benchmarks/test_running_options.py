"""benchmarks.running's options that shape the stack it measures (docs/BENCHMARKS.md, "Worker
memory"): applied to the configuration, checked without starting one."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks.running import configure
from iris.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def options(**over: Any) -> argparse.Namespace:
    base: dict[str, Any] = dict(
        peer_slots=0,
        fresh=1,
        max_per_peer=None,
        retention_s=0,
        safety_poll_s=None,
        no_sandbox=False,
        cached_workflows=0,
    )
    return argparse.Namespace(**{**base, **over})


def test_no_sandbox_turns_every_clusters_sandbox_off(tmp_path: Path) -> None:
    gate: Any = SimpleNamespace(dir=tmp_path)
    for flag, want in ((False, {"auto"}), (True, {"off"})):
        cfg = load_config(ROOT / "config" / "clusters.toml")
        apply, _ = configure(options(no_sandbox=flag, safety_poll_s=60.0), 10, gate)
        apply(cfg)
        assert {c.sandbox for c in cfg.clusters} == want
        assert cfg.mirror_safety_poll_s == 60.0
