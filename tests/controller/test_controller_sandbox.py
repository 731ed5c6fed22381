"""The job sandbox of the process backend (docs/SECURITY.md, "The job sandbox"), against real
controller processes running real jobs as root: from inside a job, nothing of the host's loopback
answers, ``/proc`` holds only the job, another job's files and ``/tmp`` are out of sight, a
``setsid`` child ends with its job, and each running job has its own non-root uid. A README-style
``python script.py`` runs with the venv's interpreter that lives under a 0700 ``/root``. Without
bwrap the controller says so once, and its capacity report and ``iris peers`` show it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from controller_harness import (
    Controller,
    cluster,
    cpu_backend,
    federation,
    key_auth,
    make_keys,
    poll,
    process_alive,
    read_all_logs,
    request,
    run_controller_cli,
    signer_for,
    start_controller,
    wait_terminal,
    write_config,
)

from cli.peers import peers_table
from iris.bundle import pack
from iris.config import load_config
from iris.controller.client import ControllerClient
from iris.controller.identity import TokenSigner
from iris.controller.models import ControllerJobState as S
from iris.reports import FederationView, cluster_report

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the acceptance runs jobs under a root controller"),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed"),
]


@dataclass
class World:
    root: Path
    ctl: Controller
    other: Controller
    signer: TokenSigner

    def client(self) -> ControllerClient:
        return self.ctl.client(self.signer, timeout=30.0)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """Two controllers as root with the sandbox on (the default), run_as left at "nobody": "peer"
    runs the jobs, "other" is one more controller a job must not reach."""
    root = tmp_path_factory.mktemp("sandbox")
    key_dir = root / "keys"
    make_keys(key_dir, "home", "peer", "other")
    home = cluster("home", auth=key_auth("home"))
    peer = cluster(
        "peer",
        backends=[cpu_backend(cpu_slots=4)],
        auth=key_auth("peer", trusted_requesters=["home"], allowed_submitters=["*"]),
        run_as="nobody",
        sandbox="auto",
    )
    other = cluster(
        "other",
        backends=[cpu_backend()],
        auth=key_auth("other", trusted_requesters=["home"]),
        sandbox="auto",
    )
    cfg = write_config(root / "clusters.toml", federation(home, peer, other))
    # The job's PATH is the controller's: the venv's bin first, as under `uv run`.
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"}
    ctl = start_controller(cfg, "peer", root / "peer", port=peer["port"], key_dir=key_dir, env=env)
    try:
        other_ctl = start_controller(cfg, "other", root / "other", port=other["port"], key_dir=key_dir)
        try:
            yield World(root, ctl, other_ctl, signer_for(cfg, "home", key_dir))
        finally:
            other_ctl.stop()
    finally:
        ctl.stop()


def job_py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


async def run_job(world: World, command: list[str], **env: str) -> str:
    req = request(command, backend_id="cpu", env=env or None)
    async with world.client() as c:
        await c.launch(req)
        status = await wait_terminal(c, req.job_id, timeout=60)
        text = await read_all_logs(c, req.job_id)
    assert status.state is S.SUCCEEDED, (status, text)
    return text


def last_json(text: str) -> dict[str, object]:
    data: dict[str, object] = json.loads(text.strip().splitlines()[-1])
    return data


async def wait_log(client: ControllerClient, job_id: str, needle: str) -> str:
    async def read() -> str:
        return (await client.logs(job_id, 0)).data

    return await poll(read, lambda text: needle in text, timeout=60, what=f"{needle!r} in {job_id}'s log")


@contextlib.contextmanager
def listening(host: str = "127.0.0.1") -> Iterator[int]:
    """A socket that accepts connections (the kernel completes them, nobody reads): what a
    Temporal frontend, an emulator or a metrics endpoint looks like to a connecting job."""
    with socket.socket() as s:
        s.bind((host, 0))
        s.listen(16)
        yield s.getsockname()[1]


def host_address() -> str | None:
    """One of the host's own non-loopback addresses, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the route's source
        except OSError:
            return None
        addr: str = s.getsockname()[0]
    return None if addr.startswith("127.") else addr


CONNECT = r"""
import json, os, socket
out = {}
for item in os.environ["TARGETS"].split(";"):
    name, host, port = item.split(",")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
        out[name] = "connected"
    except OSError as exc:
        out[name] = type(exc).__name__
# Control: the job's own loopback works.
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); s.listen(1)
    socket.create_connection(s.getsockname(), timeout=5).close()
    out["own_loopback"] = "connected"
print(json.dumps(out))
"""


async def test_a_job_reaches_no_service_of_the_host(world: World) -> None:
    """Acceptance: Temporal-like, emulator-like and metrics-like ports, both controllers (and the
    host's own address) refuse the job; its own loopback works."""
    with listening() as temporal, listening() as s3, listening() as gcs, listening() as metrics:
        targets = {
            "temporal": ("127.0.0.1", temporal),
            "s3_emulator": ("127.0.0.1", s3),
            "gcs_emulator": ("127.0.0.1", gcs),
            "metrics": ("127.0.0.1", metrics),
            "this_controller": ("127.0.0.1", world.ctl.port),
            "other_controller": ("127.0.0.1", world.other.port),
        }
        with contextlib.ExitStack() as stack:
            addr = host_address()
            if addr is not None:
                targets["host_address"] = (addr, stack.enter_context(listening("0.0.0.0")))
            spec = ";".join(f"{name},{host},{port}" for name, (host, port) in targets.items())
            out = last_json(await run_job(world, job_py(CONNECT), TARGETS=spec))
    assert out.pop("own_loopback") == "connected", out
    assert set(out) == set(targets)
    for name, result in out.items():
        assert result != "connected", f"the job reached {name}: {out}"


PROCS = r"""
import json, os
seen = {}
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            seen[pid] = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode().strip()
        except OSError:
            pass
print(json.dumps(seen))
"""


async def test_proc_shows_only_the_jobs_own_processes(world: World) -> None:
    """Acceptance: /proc lists the sandbox's init (bwrap) and the job; not the controller, not
    the test, not another controller."""
    marker = "iris-proc-marker-7c1e"
    seen = last_json(await run_job(world, [*job_py(PROCS), marker]))
    others = {pid: c for pid, c in seen.items() if not (marker in str(c) or str(c).startswith("bwrap "))}
    assert not others, others
    assert any(marker in str(c) for c in seen.values()), seen


HOLDER = r"""
import json, os, time
open("/tmp/secret-a", "w").write("in a's tmp")
open("secret-a", "w").write("in a's workdir")
print(json.dumps({"cwd": os.getcwd(), "uid": os.getuid()}), flush=True)
while not os.path.exists("release"):
    time.sleep(0.05)
"""

PRYING = r"""
import errno, json, os
a = os.environ["A_CWD"]
out = {"uid": os.getuid()}
def attempt(name, fn):
    try:
        fn()
        out[name] = "READ"
    except OSError as exc:
        out[name] = errno.errorcode.get(exc.errno, str(exc.errno))
attempt("a_tmp", lambda: open("/tmp/secret-a").read())
attempt("a_workdir_file", lambda: open(os.path.join(a, "secret-a")).read())
attempt("a_workdir", lambda: os.listdir(a))
out["work_dirs"] = os.listdir(os.path.dirname(a))
out["own_dir"] = os.path.basename(os.getcwd())
print(json.dumps(out))
"""


async def test_two_jobs_cannot_read_each_other_and_have_distinct_uids(world: World) -> None:
    """Acceptance: while job A runs, job B cannot read A's /tmp or working directory; both run as
    non-root uids, different from each other."""
    holder = request(job_py(HOLDER), backend_id="cpu")
    async with world.client() as c:
        await c.launch(holder)
        try:
            a = last_json(await wait_log(c, holder.job_id, '"cwd"'))
            a_cwd = Path(str(a["cwd"]))
            assert a_cwd.parent == world.ctl.state_dir / "work"
            b = last_json(await run_job(world, job_py(PRYING), A_CWD=str(a_cwd)))
        finally:
            (a_cwd / "release").touch()
        assert (await wait_terminal(c, holder.job_id, timeout=60)).state is S.SUCCEEDED
    for name in ("a_tmp", "a_workdir_file", "a_workdir"):
        assert b[name] in ("ENOENT", "EACCES", "EPERM"), (name, b)
    # The state dir's work/ shows B its own directory, nothing else.
    assert b["work_dirs"] == [b["own_dir"]], b
    assert a["uid"] != 0 and b["uid"] != 0 and a["uid"] != b["uid"], (a, b)


SPAWNER = r"""
import os, subprocess, sys, time
# A daemon of its own session with an empty environment: no process group and no IRIS_RUN_ID
# lead back to the job.
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", sys.argv[1]],
                 start_new_session=True, env={}, stdin=subprocess.DEVNULL,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print("spawned in", os.getcwd(), flush=True)
while not os.path.exists("release"):
    time.sleep(0.05)
"""


def pids_with(marker: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline.split(b"\0") and process_alive(int(name)):
                found.append(int(name))
    return found


async def test_a_setsid_child_ends_with_its_job(world: World) -> None:
    """Acceptance: a setsid child (own session, empty environment) is gone within 5 s of the
    job's end."""
    marker = f"iris-setsid-marker-{os.getpid()}"
    job = request([*job_py(SPAWNER), marker], backend_id="cpu")
    async with world.client() as c:
        await c.launch(job)
        log = await wait_log(c, job.job_id, "spawned in")
        children = await poll(
            lambda: asyncio.to_thread(pids_with, marker), bool, what="the child on the host"
        )
        (Path(log.split("spawned in ", 1)[1].splitlines()[0]) / "release").touch()
        assert (await wait_terminal(c, job.job_id, timeout=60)).state is S.SUCCEEDED
    try:
        # The acceptance bound: gone within 5 s of the job's end.
        await poll(
            lambda: asyncio.to_thread(lambda: [p for p in children if process_alive(p)]),
            lambda alive: not alive,
            timeout=5.0,
            what="the setsid child to be gone",
        )
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


SCRIPT = """\
import os, sys
print(f"hello from my_training_script.py as uid {os.getuid()} with {sys.executable}")
"""


async def test_python_script_runs_as_root_with_the_venvs_interpreter(world: World, tmp_path: Path) -> None:
    """Acceptance: the README's `python my_training_script.py` (its workspace shipped as a bundle),
    under a root controller whose PATH starts with the venv's bin, whose interpreter links under
    /root (0700 here): it runs and prints, as a uid other than 0."""
    (tmp_path / "my_training_script.py").write_text(SCRIPT)
    bundle = pack(tmp_path)
    assert bundle is not None
    req = request(["python", "my_training_script.py"], backend_id="cpu").model_copy(
        update={"bundle": bundle.ref}
    )
    async with world.client() as c:
        await c.put_bundle(bundle.ref.sha256, bundle.data)
        await c.launch(req)
        status = await wait_terminal(c, req.job_id, timeout=60)
        text = await read_all_logs(c, req.job_id)
    assert status.state is S.SUCCEEDED, (status, text)
    line = next(x for x in text.splitlines() if x.startswith("hello from my_training_script.py"))
    uid = int(line.split("as uid ")[1].split()[0])
    assert uid != 0 and uid in load_config(world.ctl.config_path).cluster("peer").sandbox_uid_range, line
    assert line.endswith(f"with {Path(sys.executable).parent / 'python'}"), line


async def test_the_jobs_environment_reaches_only_the_job(world: World) -> None:
    """The job's own environment never reaches bwrap or setpriv (which run as root): a bad
    LD_PRELOAD is complained about by the dynamic loader once, for the job's own process."""
    out = await run_job(world, job_py("print('ran')"), LD_PRELOAD="/nonexistent/iris-preload-probe.so")
    complaints = [line for line in out.splitlines() if "iris-preload-probe.so" in line]
    assert "ran" in out.splitlines() and len(complaints) == 1, out


async def test_a_command_missing_from_the_sandbox_cannot_start(world: World, tmp_path: Path) -> None:
    """A command that exists on the host, outside the job's view, fails like a missing one."""
    tool = tmp_path / "host-only-tool"
    tool.write_text("#!/bin/sh\necho reached\n")
    tool.chmod(0o755)
    req = request([str(tool)], backend_id="cpu")
    async with world.client() as c:
        await c.launch(req)
        status = await wait_terminal(c, req.job_id, timeout=60)
    assert status.state is S.FAILED and status.exit_code == 127, status
    assert status.error is not None and status.error.startswith(f"cannot start {str(tool)!r}"), status


async def test_host_network_is_an_explicit_choice(tmp_path: Path) -> None:
    """sandbox_host_network = true: the job reaches the host's loopback (what the option gives up),
    and the controller says so at start."""
    peer = cluster("peer", backends=[cpu_backend()], sandbox="auto")
    peer["sandbox_host_network"] = True
    cfg = write_config(tmp_path / "clusters.toml", federation(cluster("home"), peer))
    ctl = start_controller(cfg, "peer", tmp_path / "state", port=peer["port"])
    try:
        with listening() as port:
            req = request(job_py(CONNECT), backend_id="cpu", env={"TARGETS": f"service,127.0.0.1,{port}"})
            async with ctl.client() as c:
                await c.launch(req)
                assert (await wait_terminal(c, req.job_id, timeout=60)).state is S.SUCCEEDED
                out = last_json(await read_all_logs(c, req.job_id))
        assert out["service"] == "connected", out
        lines = [x for x in ctl.log_text().splitlines() if "sandbox_host_network = true" in x]
        assert len(lines) == 1 and " WARNING " in lines[0], ctl.log_text()
    finally:
        ctl.stop()


async def test_without_bwrap_the_controller_says_so_once_and_reports_it(tmp_path: Path) -> None:
    """Acceptance: no bwrap on the controller's PATH: one WARNING line at start naming what is
    lost; the backend's capacity report and `iris peers` show "none: <why>"."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    peer = cluster("peer", backends=[cpu_backend(), cpu_backend(id="cpu2")], sandbox="auto")
    cfg = write_config(tmp_path / "clusters.toml", federation(cluster("home"), peer))
    ctl = start_controller(cfg, "peer", tmp_path / "state", port=peer["port"], env={"PATH": str(empty)})
    try:
        lines = [x for x in ctl.log_text().splitlines() if "no job sandbox" in x]
        assert len(lines) == 1 and " WARNING " in lines[0], ctl.log_text()
        assert "bwrap not found on PATH" in lines[0] and "network" in lines[0], lines
        report = await cluster_report(load_config(cfg), "peer")
        assert report.reachable, report
        assert [b.sandbox for b in report.backends] == [
            "none: bwrap not found on PATH (Debian: apt-get install bubblewrap)"
        ] * 2
        view = FederationView(home="home", stale_after_ms=30_000, reports=[report])
        table = peers_table(view)
        assert table[0].split()[-1] == "SANDBOX", table
        assert all("none: bwrap not found on PATH" in row for row in table[1:]), table
    finally:
        ctl.stop()


def test_a_required_sandbox_the_host_cannot_give_is_one_config_error(tmp_path: Path) -> None:
    peer = cluster("peer", backends=[cpu_backend()], sandbox="required")
    cfg = write_config(tmp_path / "clusters.toml", federation(cluster("home"), peer))
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "iris.controller",
            "--config",
            str(cfg),
            "--cluster",
            "peer",
            "--state-dir",
            str(tmp_path / "s"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": str(empty)},
    )
    assert res.returncode == 2, res
    assert res.stderr.strip().splitlines() == [
        "iris controller: cluster peer: sandbox = required, but bwrap not found on PATH "
        "(Debian: apt-get install bubblewrap)"
    ]


def test_a_uid_pool_holding_an_account_is_one_config_error(tmp_path: Path) -> None:
    """A pool that holds an existing account (here nobody's uid) would give jobs its files."""
    peer = cluster("peer", backends=[cpu_backend()], sandbox="auto")
    peer["sandbox_uids"] = "65530-65534"
    cfg = write_config(tmp_path / "clusters.toml", federation(cluster("home"), peer))
    res = run_controller_cli(["--config", str(cfg), "--cluster", "peer", "--state-dir", str(tmp_path / "s")])
    assert res.returncode == 2, res
    assert res.stderr.strip().splitlines() == [
        "iris controller: cluster peer: sandbox_uids 65530-65534 holds existing accounts: nobody (65534)"
    ]


GRACEFUL = r"""
import os, signal, sys, time
def stop(signum, frame):
    print("got SIGTERM as pid", os.getpid(), flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


async def test_a_terminated_job_gets_its_sigterm_inside_the_sandbox(world: World) -> None:
    """A terminate reaches the job's own process as SIGTERM (its handler runs: the grace is kept),
    not as the sandbox's sudden end."""
    req = request(job_py(GRACEFUL), backend_id="cpu")
    async with world.client() as c:
        await c.launch(req)
        await wait_log(c, req.job_id, "ready")
        await c.terminate(req.job_id)
        status = await wait_terminal(c, req.job_id, timeout=60)
        text = await read_all_logs(c, req.job_id)
    assert status.state is S.KILLED, (status, text)
    assert "got SIGTERM as pid 2" in text, text  # the job is pid 2 of its own namespace


STUBBORN = r"""
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


async def test_a_job_that_ignores_sigterm_is_killed_after_the_grace(world: World) -> None:
    req = request(job_py(STUBBORN), backend_id="cpu")
    async with world.client() as c:
        await c.launch(req)
        await wait_log(c, req.job_id, "ready")
        await c.terminate(req.job_id)
        status = await wait_terminal(c, req.job_id, timeout=60)
    assert status.state is S.KILLED, status
    assert status.tasks[0].exit_code == 128 + signal.SIGKILL, status


async def test_replicas_of_one_job_share_its_uid_and_directory(world: World) -> None:
    """Each replica is a sandbox of its own, as the job's one pool uid, in the job's directory."""
    code = "import os; print('replica', os.environ['IRIS_REPLICA_INDEX'], os.getuid(), os.getcwd())"
    req = request(job_py(code), backend_id="cpu", replicas=2)
    async with world.client() as c:
        await c.launch(req)
        status = await wait_terminal(c, req.job_id, timeout=60)
        text = await read_all_logs(c, req.job_id)
    assert status.state is S.SUCCEEDED, (status, text)
    rows = sorted(line.split()[1:] for line in text.splitlines() if line.startswith("replica "))
    assert [r[0] for r in rows] == ["0", "1"], text
    assert rows[0][1:] == rows[1][1:] and rows[0][1] != "0", text


async def test_a_job_waits_for_a_free_uid_when_the_pool_is_spent(tmp_path: Path) -> None:
    """A pool of 2 uids and 4 CPU slots: the third job waits PENDING for a uid instead of failing
    (issue 31: 2,000 held jobs on a root controller's default pool of 584 uids failed 707 runs
    WORKER_FAILED, "no free uid"), and runs once a running job's uid is free again."""
    key_dir = tmp_path / "keys"
    make_keys(key_dir, "home", "peer")
    peer = cluster(
        "peer",
        backends=[cpu_backend(cpu_slots=4)],
        auth=key_auth("peer", trusted_requesters=["home"], allowed_submitters=["*"]),
        sandbox="auto",
    )
    # Outside the default pool, which other controllers of this host lease from meanwhile.
    peer["sandbox_uids"] = "200000-200001"
    cfg = write_config(tmp_path / "clusters.toml", federation(cluster("home", auth=key_auth("home")), peer))
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"}
    ctl = start_controller(cfg, "peer", tmp_path / "peer", port=peer["port"], key_dir=key_dir, env=env)
    try:
        async with ctl.client(signer_for(cfg, "home", key_dir), timeout=30.0) as c:
            holders = [request(["sleep", "300"], backend_id="cpu") for _ in range(2)]
            for req in holders:
                await c.launch(req)
            for req in holders:
                await poll(lambda r=req: c.status(r.job_id), lambda s: s.state is S.RUNNING, timeout=30)
            third = request(["true"], backend_id="cpu")
            waiting = await c.launch(third)
            assert waiting.state is S.PENDING, waiting
            assert (await c.status(third.job_id)).state is S.PENDING
            # Its devices (a CPU slot) stay promised to it: the report does not offer them twice.
            await c.terminate(holders[0].job_id)
            ended = await wait_terminal(c, third.job_id, timeout=60)
            assert ended.state is S.SUCCEEDED, ended
            await c.terminate(holders[1].job_id)
            await wait_terminal(c, holders[1].job_id, timeout=60)
    finally:
        ctl.stop()
