"""``benchmarks.running`` refuses, in one line and before any stack starts, a job count whose
processes the host's ``kernel.pid_max`` cannot hold (three per held job: 10,000 jobs need 30,000
pids, and a host's default is often 32,768)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.running import PIDS_PER_JOB, host_tasks, pid_shortfall


def test_a_count_the_pid_space_holds_is_let_through(tmp_path: Path) -> None:
    pid_max = tmp_path / "pid_max"
    pid_max.write_text(f"{host_tasks() + PIDS_PER_JOB * 2000 + 5000}\n")
    assert pid_shortfall(2000, pid_max) is None


def test_a_count_past_pid_max_is_refused_with_the_fix(tmp_path: Path) -> None:
    pid_max = tmp_path / "pid_max"
    pid_max.write_text("32768\n")
    # 12,000 jobs need 36,000 pids however few tasks the host runs (10,000 fit on an idle host).
    why = pid_shortfall(12_000, pid_max)
    assert why is not None and "\n" not in why
    assert "kernel.pid_max is 32768" in why and "sysctl -w kernel.pid_max=" in why


def test_an_unreadable_limit_refuses_nothing(tmp_path: Path) -> None:
    assert pid_shortfall(10_000, tmp_path / "absent") is None
