"""A local Slurm whose start fails stops what it had started (iris/slurmdev.py, SlurmCluster.start):
no munged, slurmctld or slurmd is left behind for the caller (iris dev, the chaos suite, the trace
benchmark) to find and stop."""

from __future__ import annotations

from pathlib import Path

import pytest

from iris import devstack, slurmdev


def _daemons_of(root: Path) -> list[int]:
    """Processes whose command line names ``root`` (the daemons' config, key and pid files)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(root).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_a_start_that_times_out_leaves_no_daemon(tmp_path: Path) -> None:
    why = slurmdev.unavailable()
    if why is not None:
        pytest.skip(why)
    cluster = slurmdev.SlurmCluster(slurmdev.SlurmSpec(gres={"h100": 1}), tmp_path / "slurm")
    with pytest.raises(devstack.ServiceError):
        cluster.start(timeout=0.001)  # munged starts; slurmctld cannot answer in a millisecond
    assert cluster.munged is not None  # something had started
    assert _daemons_of(tmp_path) == []
    assert not cluster.runtime.exists()
