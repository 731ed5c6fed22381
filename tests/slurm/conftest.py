"""The Slurm tests' real single-node Slurm (iris/slurmdev.py), started once per test process.

Every module here marks its tests ``xdist_group("slurm")`` (tests/conftest.py honours a test's own
mark), so one test process runs them all, one after the other, on one Slurm: ``slurm``. Its node has
GPUs of one GRES type per scenario (``t-<scenario>``, tests/slurm/slurm_harness.py) and of the
Slurm-backed stack's peers (config/clusters-slurm.toml), so a test never sees another's jobs in its
capacity, as users of one Ray head keep apart by resource name. A test that breaks Slurm itself
(kills slurmd) starts one of its own (``own_slurm``). ``slurm_stack`` is the federation of
config/clusters-slurm.toml on ``slurm``: its GPU peers' backends run their jobs as Slurm jobs.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

# The controller tests' harness and the preemption tests' feed checker are shared.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "controller"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "preemption"))

from isolation import isolation_violations
from secret_scan import report, scan_stack
from slurm_harness import session_gres
from stack import Stack, StackRunner

from iris import devstack, slurmdev

# A stack start that fails is retried on fresh ports this often (as tests/conftest.py does).
STACK_START_TRIES = 3


def _require_slurm() -> None:
    why = slurmdev.unavailable()
    if why is not None:
        pytest.skip(why)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurmdev.SlurmCluster]:
    """The test process's one single-node Slurm, for every Slurm test."""
    _require_slurm()
    spec = slurmdev.SlurmSpec(gres=session_gres())
    with slurmdev.running(spec, tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture
def own_slurm(tmp_path: Path) -> Iterator[slurmdev.SlurmCluster]:
    """A single-node Slurm of the test's own, for a test that kills its daemons."""
    _require_slurm()
    with slurmdev.running(slurmdev.SlurmSpec(gres={"t-own": 8}), tmp_path / "slurm") as cluster:
        yield cluster


@pytest.fixture(scope="session")
async def slurm_stack(
    tmp_path_factory: pytest.TempPathFactory,
    stack_keys: Path,
    session_files: None,
    slurm: slurmdev.SlurmCluster,
) -> AsyncIterator[Stack]:
    """The whole federation with its GPU peers on ``slurm``; checked at its teardown like the
    session's other stacks (tests/conftest.py, ``running_stack``)."""
    for attempt in range(1, STACK_START_TRIES + 1):
        runner = StackRunner(tmp_path_factory.mktemp("stack-slurm"), "slurm", key_dir=stack_keys, slurm=slurm)
        try:
            stack = await runner.start()
            break
        except (devstack.ServiceError, OSError, RuntimeError) as exc:
            await runner.stop()
            if attempt == STACK_START_TRIES:
                raise
            print(f"\nstack start {attempt} failed, retrying on fresh ports: {exc}")
    try:
        yield stack
        assert isolation_violations(stack) == []
        scan = await scan_stack(stack, [tmp_path_factory.getbasetemp()])
        print("\nslurm stack: " + report(scan))
        assert scan.items.get("history", 0) > 0
        assert scan.hits == [], "\n".join(scan.hits[:50])
    finally:
        await runner.stop()
