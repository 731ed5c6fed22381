"""Retention (docs/DESIGN.md, "Retention"): a finished job's record, logs and work directories are
removed ``retention_s`` after it ended, readers of the change feed see a tombstone, a job that is
not finished is never removed, and it all survives a restart. Against real controller processes,
with a tiny ``retention_s`` and ``IRIS_RETENTION_SWEEP_S`` shortened to a fraction of a second."""

from __future__ import annotations

import os
import pwd
import shutil
import sqlite3
import tempfile
from pathlib import Path

import pytest
from controller_harness import (
    Controller,
    cluster,
    cpu_backend,
    federation,
    gpu_backend,
    poll,
    py,
    request,
    restart,
    run_controller_cli,
    sandboxed,
    start_controller,
    wait_terminal,
    world_python,
    write_config,
)

from iris.config import ClusterConfig
from iris.controller.client import ControllerClient
from iris.controller.errors import NotFound
from iris.controller.executors.base import log_path_for
from iris.controller.models import ControllerJobState as S
from iris.controller.models import LaunchRequest
from iris.controller.retention import SWEEP_ENV, remove_tree
from iris.controller.state import JobRecord, StateStore, now_ms

SWEEP_S = "0.3"
# Writes into its working directory (HOME), including a read-only directory, then prints.
WRITE_WORKDIR = (
    "import os; d = os.path.join(os.environ['HOME'], 'out', 'deep'); os.makedirs(d); "
    "open(os.path.join(d, 'f'), 'w').write('x'); os.chmod(d, 0o500); "
    "os.chmod(os.path.dirname(d), 0o500); print('wrote', flush=True)"
)


def _peer(tmp_path: Path, retention_s: float) -> Controller:
    peer = cluster("peer", backends=[gpu_backend(slots=4)])
    peer["retention_s"] = retention_s
    cfg = write_config(tmp_path / "c.toml", federation(cluster("home"), peer))
    return start_controller(cfg, "peer", tmp_path / "state", port=peer["port"])


def _work_dirs(state_dir: Path, job_id: str, attempt: int) -> list[Path]:
    stem = log_path_for(state_dir, job_id, attempt).stem
    return sorted((state_dir / "work").glob(f"{stem}-*"))


def _rows(state_dir: Path, job_id: str) -> int:
    with sqlite3.connect(state_dir / "controller.db") as db:
        return int(db.execute("SELECT COUNT(*) FROM jobs WHERE job_id = ?", (job_id,)).fetchone()[0])


async def _gone(c: ControllerClient, job_id: str, timeout: float = 30.0) -> None:
    async def missing() -> bool:
        try:
            await c.status(job_id)
        except NotFound:
            return True
        return False

    await poll(missing, bool, timeout=timeout, interval=0.2, what=f"{job_id} removed")


async def _cursor(c: ControllerClient) -> str:
    page = await c.jobs_page(0, 1000)
    assert page.cursor is not None
    return page.cursor


async def test_finished_jobs_are_removed_and_running_ones_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SWEEP_ENV, SWEEP_S)
    ctl = _peer(tmp_path, retention_s=3.0)
    state = ctl.state_dir
    try:
        async with ctl.client() as c:
            cursor = await _cursor(c)
            # Running from the start: older than retention_s long before it ends.
            await c.launch(request(py("import time; time.sleep(60)"), job_id="ret/long", gpus=1))
            # Two attempts of one job id: both logs and both work directories go.
            await c.launch(request(py(WRITE_WORKDIR), job_id="ret/done", gpus=1, nonce="n1"))
            assert (await wait_terminal(c, "ret/done")).state is S.SUCCEEDED
            await c.launch(request(py(WRITE_WORKDIR), job_id="ret/done", gpus=1, nonce="n2"))
            done = await wait_terminal(c, "ret/done")
            assert done.state is S.SUCCEEDED and done.attempts == 2
            for attempt in (1, 2):
                assert log_path_for(state, "ret/done", attempt).read_text() == "wrote\n"
                (workdir,) = _work_dirs(state, "ret/done", attempt)
                assert (workdir / "out" / "deep" / "f").exists()
            assert _rows(state, "ret/done") == 1

            await _gone(c, "ret/done")
            for attempt in (1, 2):
                assert not log_path_for(state, "ret/done", attempt).exists()
                assert _work_dirs(state, "ret/done", attempt) == []
            assert _rows(state, "ret/done") == 0
            with pytest.raises(NotFound):
                await c.logs("ret/done", 0)
            assert "ret/done" not in [j.job_id for j in await c.list_jobs()]
            # The feed: a tombstone for the removed job, the running one as it is.
            seen = await c.changes(cursor)
            assert not seen.resync
            assert seen.removed == ["ret/done"]
            assert [j.job_id for j in seen.jobs] == ["ret/long"]

            # A sweep that removes a job ending after the running one's launch ran when the running
            # one was past retention_s already: it stays.
            await c.launch(request(py("print('marker')"), job_id="ret/marker", gpus=1))
            await wait_terminal(c, "ret/marker")
            await _gone(c, "ret/marker")
            long = await c.status("ret/long")
            assert long.state is S.RUNNING
            assert now_ms() - long.created_ms > 3000
            assert log_path_for(state, "ret/long", 1).exists() and _work_dirs(state, "ret/long", 1)
            assert _rows(state, "ret/long") == 1
            # Once it ends, it goes too; a feed reader behind both sees both tombstones.
            await c.terminate("ret/long")
            await _gone(c, "ret/long")
            assert _work_dirs(state, "ret/long", 1) == [] and _rows(state, "ret/long") == 0
            assert sorted((await c.changes(cursor)).removed) == ["ret/done", "ret/long", "ret/marker"]
            # The same job id can be launched anew: a fresh first attempt.
            again = await c.launch(request(py("print('again')"), job_id="ret/done", gpus=1, nonce="n3"))
            assert again.attempts == 1
            assert (await wait_terminal(c, "ret/done")).state is S.SUCCEEDED
            assert log_path_for(state, "ret/done", 1).read_text() == "again\n"
    finally:
        ctl.stop()


async def test_retention_survives_a_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SWEEP_ENV, SWEEP_S)  # inherited by the restarted processes
    ctl = _peer(tmp_path, retention_s=3.0)
    state = ctl.state_dir
    try:
        async with ctl.client() as c:
            await c.launch(request(py("print('a')"), job_id="ret/a", gpus=1))
            await wait_terminal(c, "ret/a")
        ctl.kill9()
        ctl = restart(ctl)
        async with ctl.client() as c:
            await _gone(c, "ret/a")
            assert not log_path_for(state, "ret/a", 1).exists() and _rows(state, "ret/a") == 0
            # A job of this start, removed by a later sweep of this start.
            await c.launch(request(py("print('b')"), job_id="ret/b", gpus=1))
            await wait_terminal(c, "ret/b")
            page = await c.jobs_page(0, 1)
            assert [j.job_id for j in page.jobs] == ["ret/b"] and page.next_after is not None
            seq_b = page.next_after
            cursor = await _cursor(c)
            await _gone(c, "ret/b")
            assert not log_path_for(state, "ret/b", 1).exists() and _rows(state, "ret/b") == 0
            assert (await c.changes(cursor)).removed == ["ret/b"]
        # Another restart, on an empty store: a later job never takes the seq of a removed one,
        # so a reader's ``after`` from before still sees every job launched since.
        ctl.stop()
        ctl = restart(ctl)
        async with ctl.client() as c:
            await c.launch(request(py("print('c')"), job_id="ret/c", gpus=1))
            assert [j.job_id for j in (await c.jobs_page(seq_b)).jobs] == ["ret/c"]
    finally:
        ctl.stop()


def _old_finished(i: int, finished_ms: int) -> JobRecord:
    req = LaunchRequest(
        job_id=f"old/{i}",
        command=["true"],
        requester="home",
        user="alice@example.com",
        nonce="n1",
        backend_id="gpu",
    )
    job = JobRecord.new(req, seq=i + 1, run_id=f"{i:032x}", attempts=1)
    job.state = S.SUCCEEDED
    job.exit_code = 0
    job.started_ms = job.finished_ms = finished_ms
    return job


async def test_a_large_backlog_is_removed_in_batches_at_start(tmp_path: Path) -> None:
    """2,600 jobs that finished a day ago (more than five batches) and one that finished just now,
    in the store before the controller starts: the sweep at start removes exactly the old ones,
    logs included, while the API answers."""
    state = tmp_path / "state"
    store = StateStore(state)
    old = now_ms() - 86_400_000
    try:
        for i in range(2600):
            store.save(_old_finished(i, old + i))
        store.save(_old_finished(9999, now_ms()))
    finally:
        store.close()
    (state / "logs").mkdir(exist_ok=True)
    for i in (0, 1299, 2599, 9999):
        log_path_for(state, f"old/{i}", 1).write_text("log\n")
    peer = cluster("peer", backends=[gpu_backend(slots=4)])
    peer["retention_s"] = 3600.0  # the default sweep interval: only the sweep at start runs
    cfg = write_config(tmp_path / "c.toml", federation(cluster("home"), peer))
    env = {k: v for k, v in os.environ.items() if k != SWEEP_ENV}
    ctl = start_controller(cfg, "peer", state, port=peer["port"], env=env)
    try:
        async with ctl.client() as c:

            async def listed() -> tuple[int, list[str]]:
                await c.health()
                ids = [j.job_id for j in await c.list_jobs()]
                return len(ids), ids[:3]

            await poll(listed, lambda found: found == (1, ["old/9999"]), timeout=60, what="backlog removed")
        for i in (0, 1299, 2599):
            assert not log_path_for(state, f"old/{i}", 1).exists()
        assert log_path_for(state, "old/9999", 1).exists()
        with sqlite3.connect(state / "controller.db") as db:
            assert db.execute("SELECT job_id FROM jobs").fetchall() == [("old/9999",)]
        assert "retention: removed 2600 job(s)" in ctl.log_text()
    finally:
        ctl.stop()


def test_a_bad_sweep_interval_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    peer = cluster("peer", backends=[gpu_backend(slots=4)])
    cfg = write_config(tmp_path / "c.toml", federation(cluster("home"), peer))
    for bad in ("soon", "0", "-5", "nan"):
        monkeypatch.setenv(SWEEP_ENV, bad)
        result = run_controller_cli(
            ["--config", str(cfg), "--cluster", "peer", "--state-dir", str(tmp_path / "s")]
        )
        assert result.returncode == 2, result.stderr
        assert SWEEP_ENV in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs a root controller")
@pytest.mark.parametrize("sandbox", ["auto", "off"])
async def test_work_dirs_of_another_user_are_removed(monkeypatch: pytest.MonkeyPatch, sandbox: str) -> None:
    """A root controller runs the job as another uid: a pool uid in the sandbox, else ``nobody``
    (its run_as). What the job left in its work directory is that uid's, some of it unreadable
    and read-only; retention removes all of it."""
    monkeypatch.setenv(SWEEP_ENV, SWEEP_S)
    # World-traversable, so the job reaches its own directory (pytest's temp dirs are 0700).
    root = Path(tempfile.mkdtemp(prefix="iris-retention-"))
    os.chmod(root, 0o755)
    try:
        peer = cluster("peer", backends=[cpu_backend(cpu_slots=2)], run_as="nobody", sandbox=sandbox)
        peer["retention_s"] = 2.0
        cfg = write_config(root / "c.toml", federation(cluster("home"), peer))
        ctl = start_controller(cfg, "peer", root / "state", port=peer["port"])
        try:
            code = WRITE_WORKDIR.replace("os.chmod(d, 0o500)", "os.chmod(d, 0o000)")
            async with ctl.client() as c:
                await c.launch(request([world_python(), "-c", code], job_id="ret/nobody", backend_id="cpu"))
                assert (await wait_terminal(c, "ret/nobody")).state is S.SUCCEEDED
                (workdir,) = _work_dirs(ctl.state_dir, "ret/nobody", 1)
                owner = (workdir / "out").stat().st_uid
                if await sandboxed(ctl):
                    assert sandbox == "auto" and owner in ClusterConfig.model_validate(peer).sandbox_uid_range
                else:  # off, or a host that cannot sandbox
                    assert owner == pwd.getpwnam("nobody").pw_uid
                await _gone(c, "ret/nobody")
                assert not workdir.exists()
        finally:
            ctl.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _remove_as(uid: int, gid: int, path: Path) -> None:
    """In a forked child with ``uid``'s privileges: remove_tree(path); exit 0 if it is gone."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            remove_tree(path)
            code = 0 if not path.exists() else 3
        except BaseException as exc:
            print(f"remove_tree as uid {uid}: {exc!r}", flush=True)
            code = 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to set up a tree owned by another user")
def test_a_controller_that_is_not_root_removes_what_its_job_locked() -> None:
    """A controller that is not root runs its jobs as itself; a job may leave directories without
    read or write permission. remove_tree gives them back to their owner and removes them."""
    user = pwd.getpwnam("nobody")
    root = Path(tempfile.mkdtemp(prefix="iris-retention-"))
    os.chmod(root, 0o755)
    try:
        workdir = root / "work-dir"
        (workdir / "a" / "b").mkdir(parents=True)
        (workdir / "a" / "b" / "f").write_text("x")
        (workdir / "c").mkdir()
        (workdir / "c" / "g").write_text("y")
        (workdir / "link").symlink_to(root)  # never followed
        for dirpath, dirnames, filenames in os.walk(workdir):
            for name in [*dirnames, *filenames, "."]:
                os.lchown(os.path.join(dirpath, name), user.pw_uid, user.pw_gid)
        os.chown(root, user.pw_uid, user.pw_gid)  # the controller's state dir: its own
        os.chmod(workdir / "a" / "b", 0o000)
        os.chmod(workdir / "a", 0o500)
        os.chmod(workdir / "c", 0o500)
        _remove_as(user.pw_uid, user.pw_gid, workdir)
        assert root.exists() and not workdir.exists()
    finally:
        shutil.rmtree(root, ignore_errors=True)
