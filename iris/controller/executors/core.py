"""The controller's executor: admission, the job table and persistence, over per-backend engines.

A backend is chosen per backend entry of the cluster config (``kind``); everything here — launch
idempotency, attempts, termination, waiting, logs by offset, the capacity report's shape — is the
same whatever the kind.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path

from iris.config import ClusterConfig
from iris.controller.bundles import BundleStore
from iris.controller.errors import AlreadyExists, InvalidArgument, NotFound, Unavailable
from iris.controller.executors.base import Backend, BackendUnreachable, log_path_for
from iris.controller.executors.process import ProcessBackend, kill_leftovers, settle_lost_run
from iris.controller.feed import ChangeFeed
from iris.controller.models import ChangeList, ControllerJobState, JobList, LaunchRequest, LogChunk
from iris.controller.state import JobRecord, StateStore, now_ms
from iris.policy.models import BackendReport

log = logging.getLogger("iris.controller.executor")

MAX_LOG_CHUNK = 1 << 20


def make_backend(cluster: ClusterConfig, index: int, host: Executor, kill_grace_s: float) -> Backend:
    config = cluster.backends[index]
    if config.kind == "ray":
        # Imported only when configured: Ray is a large import the process backend never needs.
        from iris.controller.executors.ray_jobs import RayBackend

        return RayBackend(config, host)
    if config.kind == "slurm":
        from iris.controller.executors.slurm import SlurmBackend

        return SlurmBackend(config, host, kill_grace_s=kill_grace_s)
    return ProcessBackend(config, host, kill_grace_s=kill_grace_s)


class Executor:
    """Accepts, queues, runs and reports the jobs of one cluster."""

    def __init__(
        self,
        cluster: ClusterConfig,
        state_dir: Path,
        store: StateStore,
        *,
        kill_grace_s: float = 5.0,
    ) -> None:
        self._cluster = cluster
        self._state_dir = state_dir
        self.store = store
        self.kill_grace_s = kill_grace_s
        self.jobs: dict[str, JobRecord] = {}
        self.backends: dict[str, Backend] = {
            b.id: make_backend(cluster, i, self, kill_grace_s) for i, b in enumerate(cluster.backends)
        }
        self._changed: dict[str, asyncio.Event] = {}
        self.feed = ChangeFeed()
        (state_dir / "logs").mkdir(parents=True, exist_ok=True)
        (state_dir / "work").mkdir(parents=True, exist_ok=True)
        self._bundles = BundleStore(state_dir / "bundles")
        self._bundles.sweep_uploads()

    # ---- JobHost ---------------------------------------------------------------------------

    @property
    def cluster(self) -> ClusterConfig:
        return self._cluster

    @property
    def state_dir(self) -> Path:
        return self._state_dir

    @property
    def bundles(self) -> BundleStore:
        return self._bundles

    def save(self, job: JobRecord) -> None:
        """Persist the job's record; the change feed sees it (docs/DESIGN.md, "The change feed")."""
        self.store.save(job)
        self._changed_in_feed(job)

    def _changed_in_feed(self, job: JobRecord) -> None:
        self.feed.touch(job.job_id)
        job.epoch, job.version = self.feed.epoch, self.feed.version

    def settle(
        self,
        job: JobRecord,
        state: ControllerJobState,
        *,
        exit_code: int | None = None,
        error: str | None = None,
    ) -> None:
        job.state = state
        job.exit_code = exit_code
        job.error = error
        job.finished_ms = now_ms()
        for task in job.tasks:
            if not task.state.terminal:
                task.state = state
        self.save(job)
        self.notify(job.job_id)

    def notify(self, job_id: str) -> None:
        event = self._changed.pop(job_id, None)
        if event is not None:
            event.set()

    # ---- lifecycle -------------------------------------------------------------------------

    def recover(self) -> None:
        """Load every known job; hand each backend its unfinished ones (it settles what it lost)."""
        jobs = self.store.load_all()
        live: dict[str, list[JobRecord]] = {bid: [] for bid in self.backends}
        orphans: list[JobRecord] = []
        for job in jobs:
            self.jobs[job.job_id] = job
            self._changed_in_feed(job)
            if job.terminal:
                continue
            if job.backend_id in live:
                live[job.backend_id].append(job)
            else:
                orphans.append(job)
        if orphans:
            killed = kill_leftovers({j.run_id for j in orphans if j.state is ControllerJobState.RUNNING})
            for job in orphans:
                if job.state is ControllerJobState.RUNNING:
                    settle_lost_run(self, job, killed.get(job.run_id, 0))
                else:
                    self.settle(
                        job,
                        ControllerJobState.FAILED,
                        error=f"backend {job.backend_id} is no longer configured",
                    )
        for bid, backend in self.backends.items():
            backend.recover(live[bid])

    async def shutdown(self) -> None:
        await asyncio.gather(*(b.shutdown() for b in self.backends.values()))

    # ---- retention (docs/DESIGN.md, "Retention") -------------------------------------------

    def expiring(self, runs: list[tuple[str, str]], cutoff_ms: int) -> list[JobRecord]:
        """Those of these (job id, run id) that retention may remove: still that run, terminal,
        and finished at or before ``cutoff_ms`` (this table is the truth; the store's index only
        proposes them)."""
        found = []
        for job_id, run_id in runs:
            job = self.jobs.get(job_id)
            if (
                job is not None
                and job.run_id == run_id
                and job.terminal
                and job.finished_ms is not None
                and job.finished_ms <= cutoff_ms
            ):
                found.append(job)
        return found

    def forget(self, runs: list[tuple[str, str]]) -> int:
        """Drop these (job id, run id), whose files and records retention removed, from the job
        table; readers of the change feed see a tombstone. A job relaunched since (another run) is
        kept. Returns how many were dropped."""
        dropped = 0
        for job_id, run_id in runs:
            job = self.jobs.get(job_id)
            if job is None or job.run_id != run_id or not job.terminal:
                continue
            del self.jobs[job_id]
            self._changed.pop(job_id, None)
            self.feed.forget(job_id, job.requester)
            dropped += 1
        return dropped

    # ---- API operations --------------------------------------------------------------------

    def launch(self, req: LaunchRequest) -> tuple[JobRecord, bool]:
        """Admit ``req``; return (job, created). Same requester + same nonce replays the job."""
        existing = self.jobs.get(req.job_id)
        attempts = 1
        if existing is not None:
            if existing.requester != req.requester:
                raise AlreadyExists(f"job {req.job_id} already exists from another requester")
            if existing.nonce == req.nonce:
                return existing, False
            if not existing.terminal:
                raise AlreadyExists(
                    f"job {req.job_id} is still {existing.state.value} under another nonce; "
                    "terminate it before launching a new run"
                )
            attempts = existing.attempts + 1
        backend = self.backends.get(req.backend_id)
        if backend is None:
            raise InvalidArgument(
                f"unknown backend {req.backend_id!r} on cluster {self.cluster.name} "
                f"(backends: {', '.join(sorted(self.backends))})"
            )
        backend.demand(req.device)
        if req.bundle is not None and not self._bundles.claim(req.bundle.sha256):
            # Not a refusal of the job: the home side uploads the bundle and launches again.
            raise NotFound(
                f"bundle {req.bundle.sha256} is not stored on cluster {self.cluster.name}; "
                f"upload it first (PUT /v1/bundles/{req.bundle.sha256})"
            )
        job = JobRecord.new(req, seq=self.store.next_seq(), run_id=uuid.uuid4().hex, attempts=attempts)
        self.jobs.pop(job.job_id, None)
        self.jobs[job.job_id] = job
        self.save(job)
        log.info(
            "job %s accepted: backend=%s band=%s requester=%s user=%s attempt=%d",
            job.job_id,
            job.backend_id,
            job.band.label,
            job.requester,
            job.user,
            job.attempts,
        )
        backend.accept(job)
        self.notify(job.job_id)
        return job, True

    def get(self, job_id: str) -> JobRecord:
        job = self.jobs.get(job_id)
        if job is None:
            raise NotFound(f"job {job_id} not found on cluster {self.cluster.name}")
        return job

    def page(self, after: int, limit: int, visible: Callable[[str], bool]) -> JobList:
        """Up to ``limit`` jobs launched after seq ``after`` (those ``visible`` to the caller), by
        the store's seq index: a page costs what it holds, not what the controller knows."""
        cursor = self.feed.cursor()
        rows = self.store.job_ids_after(after, limit)
        jobs = [j for _, jid in rows if (j := self.jobs.get(jid)) is not None and visible(j.requester)]
        next_after = rows[-1][0] if len(rows) == limit else None
        return JobList(jobs=[j.status() for j in jobs], next_after=next_after, cursor=cursor)

    def changes(self, since: str | None, limit: int, visible: Callable[[str], bool]) -> ChangeList:
        """The change feed after ``since`` (docs/DESIGN.md, "The change feed"): each changed job
        ``visible`` to the caller once, as it is now; removed ones by id; or an explicit resync."""
        found = self.feed.since(since, limit)
        if found.resync:
            return ChangeList(cursor=found.cursor, resync=True)
        jobs = [j for jid in found.changed if (j := self.jobs.get(jid)) is not None and visible(j.requester)]
        return ChangeList(
            cursor=found.cursor,
            more=found.more,
            jobs=[j.status() for j in jobs],
            removed=[jid for jid, requester in found.removed if visible(requester)],
        )

    async def terminate(
        self, job_id: str, *, nonce: str | None = None, wait_s: float | None = None
    ) -> JobRecord:
        """Kill a job (pending: dropped; running: stopped by its backend, within the kill grace).
        With ``nonce``, only that attempt's run: if another run is current, that one ended long
        ago (a new nonce is refused while a run is live) and nothing is touched."""
        job = self.get(job_id)
        if job.terminal or (nonce is not None and job.nonce != nonce):
            return job
        backend = self.backends[job.backend_id]
        if job.state is ControllerJobState.PENDING and backend.cancel_pending(job):
            log.info("job %s terminated while pending", job_id)
            return job
        if not job.terminate_requested:
            job.terminate_requested = True
            self.save(job)
            log.info("job %s: terminate requested", job_id)
            backend.stop(job)
        await self.wait_terminal(job_id, self.kill_grace_s + 2.0 if wait_s is None else wait_s)
        return job

    async def wait_terminal(self, job_id: str, timeout_s: float) -> JobRecord:
        """Wait up to ``timeout_s`` for the job to become terminal; return it either way."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        job = self.get(job_id)
        while not job.terminal:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            event = self._changed.setdefault(job_id, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), remaining)
            job = self.get(job_id)
        return job

    async def read_log(self, job_id: str, offset: int, limit: int = MAX_LOG_CHUNK) -> LogChunk:
        job = self.get(job_id)
        backend = self.backends.get(job.backend_id)
        if backend is not None and not job.terminal:
            await backend.refresh_log(job)
        return self._read_log_file(job_id, offset, limit)

    def _read_log_file(self, job_id: str, offset: int, limit: int) -> LogChunk:
        job = self.get(job_id)
        terminal = job.terminal  # read before the file so eof never skips a final write
        path = log_path_for(self.state_dir, job_id, job.attempts)
        try:
            with path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(offset)
                raw = f.read(max(0, min(limit, size - offset)))
        except FileNotFoundError:
            size, raw = 0, b""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        at_end = offset + len(raw) >= size
        # Hold back a split multi-byte character unless nothing more can ever follow it.
        text = decoder.decode(raw, final=terminal and at_end)
        consumed = len(raw) - len(decoder.getstate()[0])
        next_offset = offset + consumed
        return LogChunk(
            data=text,
            offset=offset,
            next_offset=next_offset,
            eof=terminal and next_offset >= size,
        )

    async def follow_log(
        self, job_id: str, offset: int, wait_s: float, limit: int = MAX_LOG_CHUNK
    ) -> LogChunk:
        """Like read_log, but wait up to ``wait_s`` for data beyond ``offset`` or the job's end."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            chunk = await self.read_log(job_id, offset, limit)
            if chunk.data or chunk.eof or loop.time() >= deadline:
                return chunk
            # The log is a plain file (written by the job, or mirrored from its engine): poll it.
            await asyncio.sleep(min(0.2, max(0.0, deadline - loop.time())))

    def availability(self) -> list[BackendReport]:
        """The capacity report (docs/DESIGN.md, "Capacity reports"); Unavailable when any backend's
        engine does not answer.

        The whole cluster answers UNAVAILABLE rather than omitting one backend or sending it without
        capacity: the federation then treats the cluster as unreachable and places nothing there.
        A backend left out would still take pinned jobs (force-routed), one without a block would be
        matched shape-only, and an empty block still takes ungated (CPU) jobs.
        """
        reports = []
        for bid, backend in self.backends.items():
            try:
                reports.append(backend.report())
            except BackendUnreachable as exc:
                raise Unavailable(f"backend {bid} of cluster {self.cluster.name}: {exc}") from None
        return reports
