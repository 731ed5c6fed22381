"""What the Slurm tests share: backend entries on the session's Slurm (each scenario on a GRES type
of its own), an in-process Executor on one, and looks at Slurm itself."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from controller_harness import cluster, federation
from feedcheck import FeedChecked

from iris import slurmdev
from iris.config import PROJECT_ROOT, FederationConfig, load_config
from iris.controller.errors import Unavailable
from iris.controller.executors.core import Executor
from iris.controller.executors.slurm import SlurmBackend, SlurmJob, parse_jobs
from iris.controller.models import ControllerJobState as S
from iris.controller.state import StateStore

SLURM_STACK_CONFIG = PROJECT_ROOT / "config" / "clusters-slurm.toml"
# The scenarios of the backend and preemption tests, each with GPUs of its own GRES type.
SCENARIOS = {
    "jobs": 8,
    "stop": 8,
    "cap": 8,
    "restart": 8,
    "unknown": 8,
    "youngest": 8,
    "fewest": 8,
    "bands": 8,
    "grace": 8,
    "pregrace": 8,
    "outsider": 8,
    "requeue": 8,
}
BACKEND = "slurm-h100"
# Who the jobs run as: an unprivileged user, as in production (docs/SECURITY.md, "Slurm jobs").
JOB_USER = "nobody"


def gres_type(scenario: str) -> str:
    return f"t-{scenario}"


def session_gres() -> dict[str, int]:
    """The session Slurm's GPUs: the Slurm-backed stack's peers', then one type per scenario."""
    spec = slurmdev.spec_for(load_config(SLURM_STACK_CONFIG))
    assert spec is not None
    return {**spec.gres, **{gres_type(s): n for s, n in SCENARIOS.items()}}


def slurm_backend(
    slurm: slurmdev.SlurmCluster, scenario: str, *, id: str = BACKEND, **override: Any
) -> dict[str, Any]:
    """A controller backend entry on ``slurm``, on the scenario's own GRES type."""
    return {
        "id": id,
        "kind": "slurm",
        "attributes": {"device-type": ["gpu"], "device-variant": ["h100"]},
        "devices": {"h100": SCENARIOS.get(scenario, 8)},
        "cpu_slots": 4,
        "slurm_conf": str(slurm.conf),
        "slurm_partition": slurmdev.DEFAULT_PARTITION,
        "slurm_gres": {"h100": gres_type(scenario)},
        "slurm_work_dir": str(slurm.work_dir),
        "slurm_env": {"PATH": slurm.job_path},
        "slurm_user": JOB_USER,
        "slurm_poll_s": 0.25,
        **override,
    }


def slurm_jobs(slurm: slurmdev.SlurmCluster) -> list[SlurmJob]:
    """Every job Slurm holds (finished ones included), as ``squeue --json`` says."""
    result = slurm.run("squeue", "--json", check=True)
    return parse_jobs(json.loads(result.stdout))


def slurm_job_of(slurm: slurmdev.SlurmCluster, executor: Executor, job_id: str) -> list[SlurmJob]:
    """The Slurm jobs of one run of ``job_id`` (by the comment the backend gives it)."""
    run = executor.get(job_id).run_id
    return [j for j in slurm_jobs(slurm) if j.comment == f"iris:{run}"]


class Checked(FeedChecked):
    """An Executor on one Slurm backend whose capacity report is compared with its RUNNING jobs
    after every change its change feed shows."""

    timeout_s = 60.0

    def report(self) -> tuple[dict[int, dict[str, int]], dict[str, int], dict[str, int]] | None:
        """(held by band, free, totals); None until the backend has read Slurm once."""
        try:
            reports = self.executor.availability()
        except Unavailable:
            return None
        (report,) = [r for r in reports if r.backend_id == self.backend_id]
        block = report.availability
        assert block is not None
        held = {int(h.band): dict(h.amounts) for h in block.held_by_band}
        return held, dict(block.amounts), dict(block.total_amounts)

    def expected(self) -> dict[int, dict[str, int]]:
        """What the RUNNING device jobs hold (CPU jobs hold nothing a Slurm backend reports: Slurm
        queues CPU work, docs/DESIGN.md, "The Slurm backend")."""
        held: dict[int, dict[str, int]] = {}
        for band, amounts in super().expected().items():
            devices = {token: n for token, n in amounts.items() if token != "cpu"}
            if devices:
                held[band] = devices
        return held

    def held(self) -> dict[int, dict[str, int]]:
        report = self.report()
        assert report is not None
        return report[0]

    def check(self) -> None:
        self.read_feed()
        report = self.report()
        if report is None:
            return
        assert report[0] == self.expected(), (report, self.expected())
        self.checks += 1

    @property
    def backend(self) -> SlurmBackend:
        backend = self.executor.backends[self.backend_id]
        assert isinstance(backend, SlurmBackend)
        return backend

    async def started(self, *job_ids: str) -> None:
        await self.until(f"{job_ids} running", lambda: all(self.state(j) is S.RUNNING for j in job_ids))

    async def ended(self, *job_ids: str) -> None:
        await self.until(f"{job_ids} terminal", lambda: all(self.state(j).terminal for j in job_ids))

    async def quiet(self, rounds: int = 6) -> None:
        """Let the backend's monitor complete ``rounds`` more rounds: time for it to act wrongly."""
        done = self.backend.rounds + rounds
        await self.until(f"{rounds} rounds of the Slurm monitor", lambda: self.backend.rounds >= done)


@contextlib.asynccontextmanager
async def executor_on(
    slurm: slurmdev.SlurmCluster,
    state_dir: Path,
    scenario: str,
    *,
    grace_s: float = 1.0,
    kill_grace_s: float = 1.0,
    leave: bool = False,
    **override: Any,
) -> AsyncIterator[Checked]:
    """A real Executor (in this process, its store in ``state_dir``: a second one on the same
    directory is a restarted controller) whose one backend runs on ``slurm`` in the scenario's
    GRES type; its report checked after every change. Leaving it cancels the Slurm jobs it
    started unless ``leave``."""
    peer = {
        **cluster("peer", backends=[slurm_backend(slurm, scenario, **override)]),
        "preempt_grace_s": grace_s,
    }
    config = FederationConfig.model_validate(federation(cluster("home"), peer))
    os.makedirs(state_dir, exist_ok=True)
    # As a controller process runs (iris/controller/__main__.py): what it creates is its own.
    umask = os.umask(0o077)
    store = StateStore(state_dir)
    executor = Executor(config.cluster("peer"), state_dir, store, kill_grace_s=kill_grace_s)
    executor.recover()
    checked = Checked(executor, BACKEND)
    watcher = asyncio.get_running_loop().create_task(checked.watch())
    try:
        await checked.until("the first read of Slurm", lambda: checked.report() is not None)
        yield checked
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        checked.check()
        runs = {f"iris:{j.run_id}" for j in executor.jobs.values()}
        await executor.shutdown()
        store.close()
        os.umask(umask)
        if not leave:
            await asyncio.to_thread(cancel_runs, slurm, runs)


def cancel_runs(slurm: slurmdev.SlurmCluster, comments: set[str]) -> None:
    """Cancel the live Slurm jobs with these comments (others' jobs on the session Slurm stay)."""
    live = [j for j in slurm_jobs(slurm) if j.comment in comments and not j.terminal]
    if live:
        slurm.run("scancel", *(str(j.job_id) for j in live))
