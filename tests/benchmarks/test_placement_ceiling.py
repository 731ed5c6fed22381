"""benchmarks.placement --ceiling's shape: a job's steps up to its launch, from sampled histories
(docs/BENCHMARKS.md, "Placement at sweep speed"), checked without a stack."""

from __future__ import annotations

from collections import Counter

import pytest

from benchmarks.harness import BenchError, HistoryStats
from benchmarks.placement import launch_steps


def stats(steps: str) -> HistoryStats:
    return HistoryStats(
        events=0, bytes=0, by_type=Counter(), activities=Counter(), signals=Counter(), steps=steps
    )


def test_the_most_common_history_is_cut_after_its_last_activity() -> None:
    # Two jobs sampled once RUNNING (the watcher's signal and the handle's local activity after the
    # launch), one re-offered (a second place signal): the common shape wins, cut at the launch.
    sampled = [stats("alslasl"), stats("alslasl"), stats("alsslasl")]
    assert launch_steps(sampled) == "alsla"


def test_a_job_sampled_right_after_its_launch_keeps_every_step() -> None:
    assert launch_steps([stats("alsla")]) == "alsla"


@pytest.mark.parametrize("sampled", [[], [stats("lsl")]])
def test_no_shape_to_copy_is_an_error_not_an_empty_ceiling(sampled: list[HistoryStats]) -> None:
    with pytest.raises(BenchError):
        launch_steps(sampled)
