"""`iris doctor` says what the full suite would skip here, and how to fix it (issue 27): Slurm among
the rest, whose tests start a single-node Slurm of their own."""

from __future__ import annotations

import pytest

from cli import doctor
from iris import slurmdev


def test_a_host_without_slurm_is_told_what_to_install_and_can_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(slurmdev, "missing_packages", lambda: ["munge", "slurmd"])
    installed: list[list[str]] = []
    monkeypatch.setattr(doctor.subprocess, "run", lambda argv, **_: installed.append(list(argv)))
    check = doctor.check_slurm()
    assert not check.ok and check.detail == "missing munge, slurmd (the Slurm backend's tests)"
    assert check.fix == slurmdev.INSTALL_HINT and check.install is not None
    check.install()
    assert installed[-1] == ["apt-get", "install", "-y", "-qq", "munge", "slurmd"]


def test_slurm_is_one_of_the_checks() -> None:
    assert doctor.check_slurm in doctor.CHECKS
