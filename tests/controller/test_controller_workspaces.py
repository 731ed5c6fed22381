"""One copy of a workspace bundle per controller, not one per job (docs/DESIGN.md, "Workspace
bundles"), against a real root controller running sandboxed jobs: every job of a bundle sees the
bundle's files through an overlay of the one unpacked copy, writes, appends and deletes land in
that job's own layer, the next job still sees the bundle as shipped, a hostile job that finds the
shared copy's path cannot reach it, the overlay lives in a mount namespace of the job's own
(neither the controller nor the host sees it), and retention deletes the bundle and its copy once
no job references them.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from controller_harness import (
    Controller,
    cluster,
    cpu_backend,
    federation,
    poll,
    read_all_logs,
    request,
    sandboxed,
    start_controller,
    wait_terminal,
    write_config,
)

from iris.bundle import Bundle, pack
from iris.controller.bundles import layer_of, mounts_under
from iris.controller.models import ControllerJobState as S
from iris.controller.retention import SWEEP_ENV
from iris.controller.sandbox import _children

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="overlays are mounted by a root controller"),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed"),
]

# What a job of the workspace does to its working directory: appends to a shipped file, writes a
# new one, deletes a shipped file and a shipped directory, then lists what it sees.
VANDAL = """\
import os, shutil
with open("data.txt", "a") as f:
    f.write("+changed")
open("new.txt", "w").write("mine")
os.remove("keep.txt")
shutil.rmtree("pkg")
print("vandal sees", sorted(os.listdir(".")), open("data.txt").read(), flush=True)
"""
LOOK = """\
import os
print("reader sees", sorted(os.listdir(".")), open("data.txt").read(), open("pkg/mod.py").read(), flush=True)
"""
# A job that reads the overlay's options from its own mountinfo, where the shared copy's path is
# written, and tries that path.
ESCAPE = """\
import re
opts = open("/proc/self/mountinfo").read()
found = re.findall(r"lowerdir=([^,\\s]+)", opts)
print("lowerdirs", found, flush=True)
for lower in found:
    try:
        with open(lower + "/data.txt", "a") as f:
            f.write("+escaped")
        print("ESCAPED", lower, flush=True)
    except OSError as exc:
        print("refused", type(exc).__name__, flush=True)
"""


@pytest.fixture
def workspace(tmp_path: Path) -> Bundle:
    src = tmp_path / "ws"
    (src / "pkg").mkdir(parents=True)
    (src / "data.txt").write_text("original")
    (src / "keep.txt").write_text("k")
    (src / "pkg" / "mod.py").write_text("VALUE = 1\n")
    bundle = pack(src)
    assert bundle is not None
    return bundle


@pytest.fixture
def ctl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Controller]:
    monkeypatch.setenv(SWEEP_ENV, "0.3")
    peer = cluster("peer", backends=[cpu_backend(cpu_slots=4)], run_as="nobody", sandbox="auto")
    peer["retention_s"] = 2.0
    cfg = write_config(tmp_path / "c.toml", federation(cluster("home"), peer))
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"}
    controller = start_controller(cfg, "peer", tmp_path / "state", port=peer["port"], env=env)
    try:
        yield controller
    finally:
        controller.stop()


async def _run(ctl: Controller, bundle: Bundle, code: str, job_id: str) -> str:
    req = request([sys.executable, "-c", code], job_id=job_id, backend_id="cpu").model_copy(
        update={"bundle": bundle.ref}
    )
    async with ctl.client(timeout=30.0) as c:
        await c.put_bundle(bundle.ref.sha256, bundle.data)
        await c.launch(req)
        status = await wait_terminal(c, job_id, timeout=60)
        text = await read_all_logs(c, job_id)
    assert status.state is S.SUCCEEDED, (status, text)
    return text


def _regular_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]


async def test_jobs_of_one_bundle_share_one_copy_and_write_only_their_own_layer(
    ctl: Controller, workspace: Bundle
) -> None:
    assert await sandboxed(ctl), ctl.log_text()
    state = ctl.state_dir
    vandal = await _run(ctl, workspace, VANDAL, "ws/vandal")
    assert "vandal sees ['data.txt', 'new.txt'] original+changed" in vandal, vandal
    reader = await _run(ctl, workspace, LOOK, "ws/reader")
    assert "reader sees ['data.txt', 'keep.txt', 'pkg'] original VALUE = 1" in reader, reader

    # One unpacked copy, as shipped; the jobs' directories hold only what the vandal wrote.
    (copy,) = [p for p in (state / "bundles" / "unpacked").iterdir() if not p.name.startswith(".")]
    assert copy.name == workspace.ref.sha256
    assert (copy / "data.txt").read_text() == "original" and (copy / "keep.txt").exists()
    written = sorted(p.name for p in _regular_files(state / "work"))
    assert written == ["data.txt", "new.txt"], written
    # Each run: an empty mount point (unmounted at its end) and its layer beside it, given back
    # to the controller (0700, root's).
    runs = sorted(p for p in (state / "work").iterdir() if not p.name.endswith(".layer"))
    assert len(runs) == 2
    for run in runs:
        assert list(run.iterdir()) == []
        upper = layer_of(run) / "upper"
        assert upper.stat().st_uid == 0 and stat.S_IMODE(upper.stat().st_mode) == 0o700
    assert mounts_under(state) == []  # nothing mounted, here or in the controller's namespace
    # The attack is really made: the job finds the copy's path, tries it, and is refused.
    escape = await _run(ctl, workspace, ESCAPE, "ws/escape")
    assert str(copy) in escape and "refused" in escape and "ESCAPED" not in escape, escape
    assert (copy / "data.txt").read_text() == "original"


async def test_the_overlay_is_mounted_for_the_job_alone(ctl: Controller, workspace: Bundle) -> None:
    """While a job runs, its overlay is in a mount namespace of the job's own (its sandbox's): not
    in the controller's, which every new sandbox copies (a mount per running job there made each
    start cost more with every job running: docs/BENCHMARKS.md), and not in the host's; once the
    job ends it is gone with that namespace."""
    state = ctl.state_dir
    code = "import time; print('running', flush=True); time.sleep(60)"
    req = request([sys.executable, "-c", code], job_id="ws/sleeper", backend_id="cpu").model_copy(
        update={"bundle": workspace.ref}
    )

    def work_mounts(pid: int) -> list[str]:
        try:
            lines = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
        except OSError:
            return []
        return [line for line in lines if str(state / "work") in line]

    def job_overlays() -> list[str]:
        return [line for pid in _children(ctl.proc.pid) for line in work_mounts(pid)]

    async with ctl.client(timeout=30.0) as c:
        await c.put_bundle(workspace.ref.sha256, workspace.data)
        await c.launch(req)
        await poll(lambda: asyncio.to_thread(job_overlays), bool, timeout=60, what="the job's overlay")
        line = job_overlays()[0]
        assert " overlay " in line and "nosuid" in line and "nodev" in line, line
        assert work_mounts(ctl.proc.pid) == []  # the controller's namespace holds no job's mount
        assert mounts_under(state) == []  # nor the host's
        await c.terminate("ws/sleeper")
        await wait_terminal(c, "ws/sleeper", timeout=60)
        await poll(lambda: asyncio.to_thread(job_overlays), lambda m: not m, timeout=30, what="unmount")
        assert work_mounts(ctl.proc.pid) == []


async def test_a_script_shipped_in_the_bundle_runs_by_its_relative_path(
    ctl: Controller, tmp_path: Path
) -> None:
    """The working directory is mounted only inside the job's sandbox, so the controller finds a
    relative command (``./train.sh``) in the bundle's copy, not in the (empty) directory it made;
    a name the bundle does not ship is still refused in one line."""
    src = tmp_path / "scripted"
    src.mkdir()
    script = src / "train.sh"
    script.write_text('#!/bin/sh\necho trained from "$(pwd)"\n')
    script.chmod(0o755)
    bundle = pack(src)
    assert bundle is not None
    async with ctl.client(timeout=30.0) as c:
        await c.put_bundle(bundle.ref.sha256, bundle.data)
        for job_id, command in (("ws/script", "./train.sh"), ("ws/missing", "./absent.sh")):
            req = request([command], job_id=job_id, backend_id="cpu")
            await c.launch(req.model_copy(update={"bundle": bundle.ref}))
        ran = await wait_terminal(c, "ws/script", timeout=60)
        text = await read_all_logs(c, "ws/script")
        missing = await wait_terminal(c, "ws/missing", timeout=60)
    assert ran.state is S.SUCCEEDED and "trained from " in text, (ran, text)
    assert missing.state is S.FAILED and "cannot start './absent.sh'" in (missing.error or ""), missing


async def test_retention_deletes_the_bundle_and_its_copy_after_its_last_job(
    ctl: Controller, workspace: Bundle
) -> None:
    state = ctl.state_dir
    await _run(ctl, workspace, LOOK, "ws/once")
    assert (state / "bundles" / f"{workspace.ref.sha256}.tar.gz").exists()
    assert (state / "bundles" / "unpacked" / workspace.ref.sha256).is_dir()

    def leftovers() -> list[str]:
        bundles = state / "bundles"
        return sorted(p.name for p in [*bundles.glob("*.tar.gz"), *(bundles / "unpacked").iterdir()])

    # The job goes after retention_s (2 s), then its bundle, not asked for since (2 s too).
    await poll(
        lambda: asyncio.to_thread(leftovers), lambda left: left == [], timeout=30, what="bundle deleted"
    )
    assert list((state / "work").iterdir()) == []
