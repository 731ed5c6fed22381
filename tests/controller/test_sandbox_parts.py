"""The sandbox's parts without a controller (iris/controller/sandbox.py): the bwrap argv, the view
of the host, the command check, the uid pool and its config (docs/SECURITY.md, "The job sandbox")."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from controller_harness import poll
from pydantic import ValidationError

from iris.config import ClusterConfig, uid_range
from iris.controller.sandbox import (
    SandboxView,
    UidPool,
    bwrap_argv,
    find_command,
    host_view,
    uid_busy,
)
from iris.controller.state import TaskRecord

VIEW = SandboxView(
    ro_binds=(("/usr", "/usr"), ("/etc", "/etc"), ("/opt/py/3.11", "/root/.local/py")),
    links=(("usr/bin", "/bin"),),
)


def argv(view: SandboxView = VIEW, uid: int | None = 61000) -> list[str]:
    return bwrap_argv(
        "/usr/bin/bwrap",
        view,
        workdir=Path("/srv/state/work/abc"),
        command=["python", "train.py"],
        uid=uid,
        setpriv="/usr/bin/setpriv",
        python="/opt/py/3.11/bin/python3.11",
    )


def test_namespaces_and_the_command_last() -> None:
    a = argv()
    assert a[0] == "/usr/bin/bwrap"
    assert {"--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-net"} <= set(a)
    sep = a.index("--")
    # setpriv (absolute) switches to the pool uid, then the launcher, then the job's own argv.
    assert a[sep + 1 : sep + 8] == [
        "/usr/bin/setpriv",
        "--reuid=61000",
        "--regid=61000",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--",
    ]
    assert a[sep + 8 : sep + 11] == ["/opt/py/3.11/bin/python3.11", "-I", "-S"]
    assert a[-2:] == ["python", "train.py"]
    work = "/srv/state/work/abc"
    assert a[sep - 5 : sep] == ["--bind", work, work, "--chdir", work]


def test_host_network_keeps_the_network_namespace_shared() -> None:
    view = SandboxView(ro_binds=VIEW.ro_binds, links=VIEW.links, host_network=True)
    assert "--unshare-net" not in argv(view)
    assert "--unshare-pid" in argv(view)


def test_without_a_uid_no_setpriv() -> None:
    a = argv(uid=None)
    assert "/usr/bin/setpriv" not in a and a[a.index("--") + 1] == "/opt/py/3.11/bin/python3.11"


def _pairs(a: list[str], flag: str) -> list[str]:
    return [a[i + 1] for i, x in enumerate(a) if x == flag]


def test_mount_points_parents_are_made_traversable() -> None:
    """/root/.local/py's parents are made 0755 on the sandbox's own root before the bind (bwrap
    would make them 0700: a pool uid could not pass), none inside a read-only bind, and the
    private tmp dirs keep their 1777."""
    a = argv()
    dirs = _pairs(a, "--dir")
    assert "/root" in dirs and "/root/.local" in dirs
    assert a.index("/root") < a.index("--ro-bind", a.index("/root"))
    for d in dirs:
        i = a.index(d)
        assert a[i - 3 : i - 1] == ["--perms", "0755"], d
        assert not d.startswith(("/usr/", "/etc/")), d
    assert "/srv" in dirs and "/srv/state/work" in dirs  # the work dir's parents, for its bind
    for tmp in ("/tmp", "/var/tmp", "/dev/shm"):
        i = a.index(tmp)
        assert a[i - 3 : i] == ["--perms", "1777", "--tmpfs"], tmp
        assert tmp not in dirs


def test_an_interpreter_under_tmp_is_bound_over_the_private_tmp() -> None:
    """A checkout under /tmp (CI clones there) has its venv's interpreter under /tmp: its bind goes
    on top of the job's private /tmp, after it, with its parents made traversable there; bound
    before it, the tmpfs would hide it ("cannot start …/.venv/bin/python")."""
    venv = ("/tmp/ci/.venv", "/tmp/ci/.venv")
    view = SandboxView(ro_binds=(*VIEW.ro_binds, venv), links=VIEW.links)
    a = argv(view)
    tmpfs = a.index("/tmp", a.index("--tmpfs") - 3)
    assert a[tmpfs - 1] == "--tmpfs"
    bind = a.index("/tmp/ci/.venv")
    assert a[bind - 1] == "--ro-bind" and bind > tmpfs
    i = a.index("/tmp/ci", tmpfs + 1)
    assert a[i - 3 : i] == ["--perms", "0755", "--dir"] and tmpfs < i < bind


def test_a_state_dir_inside_a_system_path_is_masked_and_no_bind_holds_it(tmp_path: Path) -> None:
    state = tmp_path / "data" / "state"
    state.mkdir(parents=True)
    outside = tmp_path / "datasets"
    outside.mkdir()
    view, skipped = host_view(
        hidden=[Path("/etc/iris-state-x"), state],
        extra_ro=[str(tmp_path / "data"), str(outside)],
        path_env="/usr/bin:/bin",
        host_network=False,
    )
    assert "/etc/iris-state-x" in view.masked and not view.visible("/etc/iris-state-x/controller.db")
    dests = [d for _, d in view.ro_binds]
    assert str(outside) in dests
    assert str(tmp_path / "data") not in dests
    assert skipped == [f"{tmp_path / 'data'} (holds the controller's state)"]


def test_find_command(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "run.sh").write_text("#!/bin/sh\n")
    (work / "run.sh").chmod(0o700)
    if os.geteuid() == 0:
        os.chown(work / "run.sh", 61001, 61001)
    hidden_tool = tmp_path / "tool"
    hidden_tool.write_text("#!/bin/sh\n")
    hidden_tool.chmod(0o755)
    view = SandboxView(ro_binds=(("/usr", "/usr"),), links=(("usr/bin", "/bin"),))
    assert find_command(view, "sh", path_env="/bin", workdir=work, uid=61001) is None
    assert find_command(view, "./run.sh", path_env="/bin", workdir=work, uid=61001) is None
    assert find_command(view, "run.sh", path_env="/bin:.", workdir=work, uid=61001) is None
    assert find_command(view, "run.sh", path_env="/bin", workdir=work, uid=61001) is not None
    assert find_command(view, str(hidden_tool), path_env="/bin", workdir=work, uid=61001) == (
        "No such file or directory in the job's sandbox"
    )
    if os.geteuid() == 0:
        # Another pool uid cannot execute a 0700 file of this one.
        assert find_command(view, "./run.sh", path_env="", workdir=work, uid=61002) == "Permission denied"


def test_uid_ranges() -> None:
    assert uid_range("60600-61183") == range(60600, 61184)
    assert uid_range(" 5-5 ") == range(5, 6)
    for bad in ("0-10", "10-5", "abc", "10", "-5-10", "1-2147483647"):
        with pytest.raises(ValueError):
            uid_range(bad)
    base = {"name": "c", "port": 1, "backends": []}
    with pytest.raises(ValidationError):
        ClusterConfig.model_validate({**base, "sandbox_uids": "100-50"})
    with pytest.raises(ValidationError):
        ClusterConfig.model_validate({**base, "sandbox": "maybe"})
    with pytest.raises(ValidationError):
        ClusterConfig.model_validate({**base, "sandbox_ro_paths": ["relative/path"]})
    c = ClusterConfig.model_validate(base)
    assert (c.sandbox, c.sandbox_host_network, c.sandbox_uid_range) == ("auto", False, range(60600, 61184))


def test_the_uid_is_saved_with_the_task() -> None:
    task = TaskRecord(index=0, uid=60700)
    assert TaskRecord.from_json(task.to_json()).uid == 60700
    assert TaskRecord.from_json({"index": 0, "state": "PENDING"}).uid is None  # an older row


root_only = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root")


def _as_uid(uid: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sleep", "300"])


@root_only
async def test_leases_are_exclusive_and_skip_busy_uids(tmp_path: Path) -> None:
    """Two pools over one range (two backends, or two controllers on one host) never hold the
    same uid at once; a uid some process runs as is never leased; a released one is."""
    first, busy, last = 64001, 64002, 64003
    proc = _as_uid(busy)
    try:
        await _busy(busy)
        a, b = UidPool(range(first, last + 1), tmp_path), UidPool(range(first, last + 1), tmp_path)
        one, two = a.lease(), b.lease()
        assert one is not None and two is not None
        assert {one.uid, two.uid} == {first, last}
        assert a.lease() is None and b.lease() is None
        one.release()
        again = b.lease()
        assert again is not None and again.uid == one.uid
    finally:
        proc.kill()
        proc.wait()


@root_only
async def test_a_uid_released_clean_skips_the_proc_look_and_one_left_held_does_not(tmp_path: Path) -> None:
    """A run's uid given back clean is leased again without looking through /proc (the look cost
    ~0.4 s a start with 4,000 processes on the host); one a dead controller left ``held`` is
    looked for, so a process of its lost run still blocks it."""
    uid = 64020
    pool = UidPool(range(uid, uid + 1), tmp_path)
    first = pool.take()
    assert first is not None and first.fresh and not first.clean  # never leased since boot
    assert not pool.busy(first)
    assert (tmp_path / str(uid)).read_bytes() == b"held"
    first.release(clean=True)
    assert (tmp_path / str(uid)).read_bytes() == b"clean"
    second = pool.lease()
    assert second is not None and second.clean
    # A controller that dies holding the uid: the kernel drops the lock, the file still says held.
    second.release()
    proc = _as_uid(uid)
    try:
        await _busy(uid)
        assert pool.lease() is None
    finally:
        proc.kill()
        proc.wait()
    third = pool.lease()
    assert third is not None and not third.clean and not third.fresh
    third.release(clean=True)


@root_only
async def test_a_never_leased_uid_a_foreign_process_runs_as_is_not_leased(tmp_path: Path) -> None:
    """A uid no controller has leased since boot is checked against one look through /proc (a
    minute old at most): a process of other origin running as it keeps it out of the pool."""
    busy, free = 64030, 64031
    proc = _as_uid(busy)
    try:
        await _busy(busy)
        pool = UidPool(range(busy, free + 1), tmp_path)
        leases = [pool.lease(), pool.lease()]
        assert [lease.uid if lease else None for lease in leases] == [free, None]
    finally:
        proc.kill()
        proc.wait()


async def _busy(uid: int) -> None:
    """Wait until a process runs as ``uid`` (the one just started has switched to it)."""
    await poll(lambda: asyncio.to_thread(uid_busy, uid), bool, timeout=30, what=f"a process as uid {uid}")


@root_only
async def test_reclaim_kills_a_lost_runs_uid_unless_another_holds_it(tmp_path: Path) -> None:
    uid = 64010
    pool = UidPool(range(uid, uid + 1), tmp_path)
    held = UidPool(range(uid, uid + 1), tmp_path).lease()
    assert held is not None
    proc = _as_uid(uid)
    try:
        await _busy(uid)
        assert pool.reclaim(uid) == 0 and proc.poll() is None  # leased by another: its job
        held.release()
        assert pool.reclaim(uid) >= 1
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
