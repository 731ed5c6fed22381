"""Retention (docs/DESIGN.md, "Retention"): a finished job is forgotten ``retention_s`` after it ended.

A sweep runs once at start and then every ``IRIS_RETENTION_SWEEP_S`` seconds (default 300). It
removes each job that finished more than the cluster's ``retention_s`` ago: its log files (every
attempt), its work directories, its row in ``controller.db``, then the job itself from the
executor's table, leaving a tombstone in the change feed. A job that is not terminal is never
removed. After the jobs, each workspace bundle that no job references any more is deleted, with its
unpacked copy.

Database and file work run in worker threads (``asyncio.to_thread``, on the store's own
connection for retention), a bounded batch at a time found by the ``jobs_finished`` index; the
event loop only checks each batch against its job table and forgets what was removed. A sweep of
100k old jobs therefore never holds the loop for more than one batch's bookkeeping.

Order, per batch: files, then rows, then memory. Until the last step the job stays visible as it
was, so a launch of the same job id with a new nonce meanwhile becomes the next attempt, whose log
and work directory names differ from every one removed, and whose record (another run id) the
removal does not touch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from iris.config import ConfigError
from iris.controller.executors.base import log_path_for
from iris.controller.executors.process import WORK_DIR, work_dir_attempt
from iris.controller.state import now_ms

if TYPE_CHECKING:
    from iris.controller.executors.core import Executor

log = logging.getLogger("iris.controller.retention")

SWEEP_ENV = "IRIS_RETENTION_SWEEP_S"
DEFAULT_SWEEP_S = 300.0
# Jobs per batch: one indexed query, one transaction of deletes, and this many jobs' bookkeeping on
# the event loop.
BATCH = 500


def sweep_interval_s(environ: Mapping[str, str] | None = None) -> float:
    """Seconds between sweeps: ``$IRIS_RETENTION_SWEEP_S`` (a positive number), else 300.
    ConfigError (one line) for anything else."""
    raw = (os.environ if environ is None else environ).get(SWEEP_ENV, "").strip()
    if not raw:
        return DEFAULT_SWEEP_S
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{SWEEP_ENV}={raw!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{SWEEP_ENV}={raw!r}: the sweep interval must be a positive number of seconds")
    return value


@dataclass(frozen=True)
class Expired:
    """One job retention removes: its current run and how many attempts left files behind."""

    job_id: str
    run_id: str
    attempts: int


def remove_tree(path: Path) -> None:
    """Remove a job's working directory and everything in it; OSError if some of it stays.

    ``shutil.rmtree`` never follows a link the job left there. A root controller can remove
    whatever its jobs (another uid) made. A controller that is not root runs its jobs as itself:
    a directory the job made read-only or unreadable is given back to its owner and tried again
    (its jobs have the controller's own privileges anyway, so nothing is gained by a path they
    change under it).
    """
    try:
        shutil.rmtree(path)
        return
    except FileNotFoundError:
        return
    except OSError:
        if os.geteuid() == 0:
            raise
    os.chmod(path, 0o700)
    for dirpath, dirnames, _files in os.walk(path):
        for name in dirnames:
            sub = os.path.join(dirpath, name)
            if not os.path.islink(sub):
                with contextlib.suppress(OSError):
                    os.chmod(sub, 0o700)
    shutil.rmtree(path)


def _work_dirs(state_dir: Path) -> dict[str, list[Path]]:
    """Every run's work directory, by ``<digest>-<attempt>`` (one listing per sweep)."""
    found: dict[str, list[Path]] = {}
    try:
        with os.scandir(state_dir / WORK_DIR) as entries:
            for entry in entries:
                found.setdefault(work_dir_attempt(entry.name), []).append(Path(entry.path))
    except FileNotFoundError:
        pass
    return found


class Retention:
    """The periodic sweep of one controller (started with the app, after ``Executor.recover``)."""

    def __init__(
        self, executor: Executor, *, retention_s: float, interval_s: float, batch: int = BATCH
    ) -> None:
        self._executor = executor
        self.retention_s = retention_s
        self.interval_s = interval_s
        self.batch = batch
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="iris-retention")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            try:
                await self.sweep()
            except Exception:  # the next sweep tries again; the API keeps serving
                log.exception("retention sweep failed")
            await asyncio.sleep(self.interval_s)

    async def sweep(self) -> int:
        """Remove every job that finished more than ``retention_s`` ago; how many were removed."""
        executor = self._executor
        cutoff_ms = now_ms() - int(self.retention_s * 1000)
        after: tuple[int, str] | None = None
        work_dirs: dict[str, list[Path]] | None = None
        removed = 0
        while True:
            rows = await asyncio.to_thread(executor.store.expired, cutoff_ms, after, self.batch)
            if not rows:
                break
            after = (rows[-1][0], rows[-1][1])
            expired = [
                Expired(job.job_id, job.run_id, job.attempts)
                for job in executor.expiring([(job_id, run_id) for _, job_id, run_id in rows], cutoff_ms)
            ]
            if expired:
                if work_dirs is None:
                    work_dirs = await asyncio.to_thread(_work_dirs, executor.state_dir)
                gone = await asyncio.to_thread(self._remove, expired, work_dirs)
                removed += executor.forget(gone)
            if len(rows) < self.batch:
                break
        if removed:
            log.info("retention: removed %d job(s) finished more than %gs ago", removed, self.retention_s)
        # Then the bundles no job references any more (their last job's retention is over), with
        # their unpacked copies; one asked for within retention_s is kept for the launch to come.
        referenced = {job.bundle for job in executor.jobs.values() if job.bundle is not None}
        deleted = await asyncio.to_thread(executor.bundles.sweep, referenced, self.retention_s)
        if deleted:
            log.info("retention: deleted %d bundle(s) no job references", len(deleted))
        return removed

    def _remove(self, expired: list[Expired], work_dirs: dict[str, list[Path]]) -> list[tuple[str, str]]:
        """In a worker thread: each job's logs and work directories, then the records of those
        whose logs are gone (a log left behind would be appended to by a later run of the same
        job id: that job stays, and the next sweep tries again). The (job id, run id) removed."""
        state_dir = self._executor.state_dir
        done: list[tuple[str, str]] = []
        for job in expired:
            try:
                for attempt in range(1, job.attempts + 1):
                    path = log_path_for(state_dir, job.job_id, attempt)
                    path.unlink(missing_ok=True)
                    for workdir in work_dirs.pop(path.stem, []):
                        try:
                            remove_tree(workdir)
                        except OSError as exc:
                            log.warning("retention: cannot remove %s of job %s: %s", workdir, job.job_id, exc)
            except OSError as exc:
                log.warning("retention: cannot remove the log of job %s (kept): %s", job.job_id, exc)
                continue
            done.append((job.job_id, job.run_id))
        return self._executor.store.remove(done)
