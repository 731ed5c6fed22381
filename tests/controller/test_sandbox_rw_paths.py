"""A cluster's ``sandbox_rw_paths`` (docs/SECURITY.md, "The job sandbox"): operator-shared writable
directories bound read-write, at their own path, into every sandboxed job. The argv puts them
after the private ``/tmp`` (a shared directory under ``/tmp`` is the host's), a read-only bind
inside one stays read-only; the controller refuses at start one that is missing, overlaps its state
or key directory, or would make a system path writable. Against a real root controller: what one
job writes there, the next job and the host read, and the rest of the host stays out of sight.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from controller_harness import (
    cluster,
    cpu_backend,
    federation,
    key_auth,
    make_keys,
    read_all_logs,
    request,
    run_controller_cli,
    signer_for,
    start_controller,
    wait_terminal,
    write_config,
)
from pydantic import ValidationError

from iris.config import ClusterConfig, ConfigError
from iris.controller.models import ControllerJobState as S
from iris.controller.sandbox import SandboxView, bwrap_argv, shared_rw_binds


def _argv(view: SandboxView) -> list[str]:
    return bwrap_argv(
        "/usr/bin/bwrap",
        view,
        workdir=Path("/srv/state/work/abc"),
        command=["true"],
        uid=61000,
        setpriv="/usr/bin/setpriv",
        python="/usr/bin/python3",
    )


def _after(a: list[str], flag: str, *args: str) -> int:
    """The index of ``flag`` followed by ``args`` in ``a``."""
    for i in range(len(a)):
        if a[i : i + 1 + len(args)] == [flag, *args]:
            return i
    raise AssertionError(f"{flag} {args} not in {a}")


def test_a_shared_dir_is_bound_read_write_after_the_private_tmp() -> None:
    view = SandboxView(
        ro_binds=(("/usr", "/usr"), ("/data/py", "/scratch/shared/py")),
        rw_binds=(("/tmp/run-1/shared", "/tmp/run-1/shared"), ("/mnt/ckpt", "/scratch/shared")),
    )
    a = _argv(view)
    tmp = _after(a, "--tmpfs", "/tmp")
    shared = _after(a, "--bind", "/tmp/run-1/shared", "/tmp/run-1/shared")
    assert tmp < shared, "under /tmp: bound after the private tmpfs, or the tmpfs would hide it"
    # Its parents exist on the sandbox's private /tmp, traversable by the pool uid.
    assert tmp < _after(a, "--dir", "/tmp/run-1") < shared
    # A read-only bind inside a shared directory goes on top of it.
    assert _after(a, "--bind", "/mnt/ckpt", "/scratch/shared") < _after(
        a, "--ro-bind", "/data/py", "/scratch/shared/py"
    )
    # Seen by the command check; the job's own directory still comes last.
    assert view.visible("/scratch/shared/run.sh") and view.visible("/tmp/run-1/shared/x")
    assert not view.visible("/tmp/run-1/other")
    assert a.index("--chdir") > shared


def test_a_relative_path_is_refused_at_load() -> None:
    with pytest.raises(ValidationError, match="not an absolute path"):
        ClusterConfig(name="c", port=1, backends=[], sandbox_rw_paths=["shared"])


def test_shared_rw_binds_refuses_what_would_expose_the_controller_or_the_system(tmp_path: Path) -> None:
    state, keys, shared = tmp_path / "data" / "state", tmp_path / "keys", tmp_path / "shared"
    for d in (state, keys, shared):
        d.mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(shared)
    protected = [("state directory", state), ("key directory", keys)]

    assert shared_rw_binds([str(shared), str(link)], protected=protected) == [
        (str(shared), str(shared)),
        (str(shared), str(link)),
    ]
    refused = {
        str(tmp_path / "missing"): "is not an existing directory",
        str(tmp_path / "data"): f"overlaps the controller's state directory {state}",
        str(state / "work"): f"overlaps the controller's state directory {state}",
        str(keys): f"overlaps the controller's key directory {keys}",
        "/": "would make /usr writable by every job",
        "/usr/share": "lies in /usr, which jobs see read-only or not at all",
        "/var": "would share /var/tmp, private to each job, between jobs",
    }
    (state / "work").mkdir()
    for path, why in refused.items():
        with pytest.raises(ConfigError) as exc:
            shared_rw_binds([path], protected=protected)
        assert str(exc.value) == f"sandbox_rw_paths: {path} {why}", exc.value
    # A link into a protected directory is refused by where it leads.
    into_keys = tmp_path / "to-keys"
    into_keys.symlink_to(keys)
    with pytest.raises(ConfigError, match="key directory"):
        shared_rw_binds([str(into_keys)], protected=protected)


def test_a_controller_refuses_a_shared_dir_over_its_keys_at_start(tmp_path: Path) -> None:
    """One config error (exit 2) at start, whether or not the host sandboxes."""
    key_dir = tmp_path / "keys"
    key_dir.mkdir()
    peer = cluster("peer", backends=[cpu_backend()], sandbox="auto")
    peer["sandbox_rw_paths"] = [str(key_dir)]
    cfg = write_config(tmp_path / "clusters.toml", federation(cluster("home"), peer))
    state = tmp_path / "s" / "peer"
    res = run_controller_cli(
        ["--config", str(cfg), "--cluster", "peer", "--state-dir", str(state), "--key-dir", str(key_dir)]
    )
    assert res.returncode == 2, res
    assert res.stderr.strip().splitlines() == [
        f"iris controller: sandbox_rw_paths: {key_dir} overlaps the controller's key directory {key_dir}"
    ]


WRITE = r"""
import os, sys
shared = sys.argv[1]
# The job's umask is the controller's (077): what it writes is its pool uid's alone...
with open(os.path.join(shared, "private"), "w") as f:
    f.write("mine")
# ...unless it makes it readable for the jobs after it, which may run as other uids.
os.umask(0o022)
with open(os.path.join(shared, "checkpoint"), "w") as f:
    f.write(f"step 7 by {os.getuid()}")
print("uid", os.getuid())
"""
READ = r"""
import os, sys
shared, hidden = sys.argv[1], sys.argv[2]
print(open(os.path.join(shared, "checkpoint")).read())
print("hidden visible:", os.path.exists(hidden))
try:
    open(os.path.join(shared, "private")).read()
    print("private readable")
except PermissionError:
    print("private unreadable")
print("uid", os.getuid())
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="runs jobs under a root controller, as pool uids")
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
async def test_jobs_share_the_rw_path_and_nothing_else(tmp_path: Path) -> None:
    """A job writes a checkpoint into the shared directory; a later job (another run, mostly
    another pool uid) reads it at the same path, and so does the host; a file the first job left
    at its umask stays its uid's; a sibling of the shared directory stays out of the jobs' sight."""
    root = tmp_path / "run"
    shared = root / "shared"
    shared.mkdir(parents=True)
    shared.chmod(0o1777)
    hidden = root / "sibling-secret"
    hidden.write_text("not for jobs")
    key_dir = root / "keys"
    make_keys(key_dir, "home", "peer")
    peer = cluster(
        "peer",
        backends=[cpu_backend()],
        auth=key_auth("peer", trusted_requesters=["home"], allowed_submitters=["*"]),
        sandbox="required",
    )
    peer["sandbox_rw_paths"] = [str(shared)]
    cfg = write_config(root / "clusters.toml", federation(cluster("home", auth=key_auth("home")), peer))
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"}
    ctl = start_controller(cfg, "peer", root / "state" / "peer", port=peer["port"], key_dir=key_dir, env=env)
    try:
        async with ctl.client(signer_for(cfg, "home", key_dir), timeout=30.0) as c:
            outputs = []
            for code, args in ((WRITE, [str(shared)]), (READ, [str(shared), str(hidden)])):
                req = request([sys.executable, "-c", code, *args], backend_id="cpu")
                await c.launch(req)
                status = await wait_terminal(c, req.job_id, timeout=60)
                text = await read_all_logs(c, req.job_id)
                assert status.state is S.SUCCEEDED, (status, text)
                outputs.append(text)
    finally:
        ctl.stop()
    uid, reader_uid = (int(out.split()[-1]) for out in outputs)
    assert 0 not in (uid, reader_uid)
    # The pool holds 584 uids: the reader runs as the writer's one time in 584.
    private = "private readable" if reader_uid == uid else "private unreadable"
    expected = [f"step 7 by {uid}", "hidden visible: False", private, f"uid {reader_uid}"]
    assert outputs[1].splitlines() == expected
    checkpoint = shared / "checkpoint"
    assert checkpoint.read_text() == f"step 7 by {uid}" and checkpoint.stat().st_uid == uid
    assert (shared / "private").stat().st_mode & 0o777 == 0o600
    assert "every job reads and writes the shared sandbox_rw_paths " + str(shared) in ctl.log_text()
