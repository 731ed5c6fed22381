"""Unprivileged jobs (docs/DESIGN.md, "Job → controller"): a root controller runs each job as its
cluster's ``run_as`` user, in a clean environment, out of reach of the controller's environment,
key directory, state directory, store and other jobs' directories.

These are the defences left where a host cannot sandbox (docs/SECURITY.md, "Job → controller"), so
the clusters here set ``sandbox = "off"``: in the sandbox (tests/controller/test_controller_sandbox.py)
``run_as`` is not used, and the job would not even see what these tests show it cannot open.

The tests need root (the suite runs as root here) and an interpreter the unprivileged user can run:
the system ``python3``, since the test interpreter may live under a 0700 home. Each test's files sit
in a world-traversable directory, so only the controller's own defences stand between the job and
them (pytest's temp dirs are 0700 and would hide everything by themselves).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import tempfile
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
    read_all_logs,
    request,
    run_controller_cli,
    signer_for,
    start_controller,
    wait_terminal,
    world_python,
    write_config,
)

from iris.controller.identity import TokenSigner
from iris.controller.models import ControllerJobState as S

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs a root controller")

SECRET = "IRIS_TEST_CONTROLLER_SECRET"
SECRET_VALUE = "s3cret-of-the-controller-7f1d"
JOB_USER = "nobody"


@dataclass
class Peer:
    ctl: Controller
    root: Path
    key_dir: Path
    signer: TokenSigner

    @property
    def state_dir(self) -> Path:
        return self.ctl.state_dir


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    """A controller as root with run_as = "nobody", its files in a world-traversable directory, keys
    and state made with the default (0755/0644) modes of a careless operator, and a secret in its
    environment."""
    root = Path(tempfile.mkdtemp(prefix="iris-privileges-"))
    os.chmod(root, 0o755)
    old = os.umask(0o022)
    try:
        key_dir = root / "keys"
        make_keys(key_dir, "home", "peer")
        os.chmod(key_dir, 0o755)
        for key in key_dir.glob("*.key"):
            os.chmod(key, 0o644)
        state_dir = root / "state"
        state_dir.mkdir(mode=0o755)
        (state_dir / "controller.db").touch(mode=0o644)  # a store left by an older version
    finally:
        os.umask(old)
    home = cluster("home", auth=key_auth("home"))
    p = cluster(
        "peer",
        backends=[cpu_backend(cpu_slots=4)],
        auth=key_auth("peer", trusted_requesters=["home"], allowed_submitters=["*"]),
        run_as=JOB_USER,
        sandbox="off",
    )
    cfg = write_config(root / "clusters.toml", federation(home, p))
    ctl = start_controller(
        cfg, "peer", state_dir, port=p["port"], key_dir=key_dir, env={SECRET: SECRET_VALUE}
    )
    try:
        yield Peer(ctl, root, key_dir, signer_for(cfg, "home", key_dir))
    finally:
        ctl.stop()
        shutil.rmtree(root, ignore_errors=True)


async def _run(peer: Peer, code: str, **env: str) -> str:
    req = request([world_python(), "-c", code], backend_id="cpu", env=env or None)
    async with peer.ctl.client(peer.signer) as c:
        await c.launch(req)
        status = await wait_terminal(c, req.job_id)
        text = await read_all_logs(c, req.job_id)
    assert status.state is S.SUCCEEDED, text
    return text


# Each attempt prints "<name>: <errno name>" or "<name>: READ <n>"; the job itself never fails.
ATTACK = r"""
import errno, os, sys
targets = dict(arg.split("=", 1) for arg in os.environ["TARGETS"].split(";"))
def attempt(name, fn):
    try:
        print(f"{name}: READ {len(fn())}", flush=True)
    except OSError as exc:
        print(f"{name}: {errno.errorcode.get(exc.errno, exc.errno)}", flush=True)
def read(path):
    with open(path, "rb") as f:
        return f.read()
attempt("controller_environ", lambda: read(f"/proc/{os.getppid()}/environ"))
attempt("key_dir", lambda: os.listdir(targets["key_dir"]))
attempt("private_key", lambda: read(targets["private_key"]))
attempt("state_dir", lambda: os.listdir(targets["state_dir"]))
attempt("controller_db", lambda: read(targets["db"]))
attempt("controller_db_wal", lambda: read(targets["db"] + "-wal"))
attempt("job_dirs", lambda: os.listdir(targets["work"]))
attempt("other_job_dir", lambda: os.listdir(targets["other"]))
attempt("other_job_file", lambda: read(os.path.join(targets["other"], "secret.txt")))
with open("mine.txt", "w") as f:
    f.write("my own file")
attempt("control", lambda: read(os.path.join(os.getcwd(), "mine.txt")))
print("uid", os.getuid(), "groups", os.getgroups())
"""

DENIED = {"EACCES", "EPERM"}


async def test_job_cannot_reach_controller_keys_store_or_other_jobs(peer: Peer) -> None:
    """Acceptance 4: a job reads /proc/$PPID/environ, the key dir, controller.db and another job's
    working directory; each is refused, while its own file reads back."""
    victim = await _run(peer, "import os; open('secret.txt', 'w').write('victim data'); print(os.getcwd())")
    other = victim.strip().splitlines()[-1]
    assert Path(other).parent == peer.state_dir / "work"
    targets = {
        "key_dir": peer.key_dir,
        "private_key": peer.key_dir / "peer.key",
        "state_dir": peer.state_dir,
        "db": peer.state_dir / "controller.db",
        "work": peer.state_dir / "work",
        "other": other,
    }
    out = await _run(peer, ATTACK, TARGETS=";".join(f"{k}={v}" for k, v in targets.items()))
    results = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    for name in (
        "controller_environ",
        "key_dir",
        "private_key",
        "state_dir",
        "controller_db",
        "controller_db_wal",
        "job_dirs",
        "other_job_dir",
        "other_job_file",
    ):
        assert results.get(name) in DENIED, f"{name}: {results.get(name)}\n{out}"
    assert results["control"] == "READ 11", out
    # It ran as nobody, without root's supplementary groups.
    assert f"uid {pwd.getpwnam(JOB_USER).pw_uid} groups []" in out, out


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_state_store_and_key_modes(peer: Peer) -> None:
    """The store (and its WAL files), logs, and key are the controller's alone, even where an older
    version or an operator left them open; the state dir and work dir are search-only."""
    await _run(peer, "print('touch the store')")
    state = peer.state_dir
    assert _mode(state) == 0o711 and _mode(state / "work") == 0o711
    assert _mode(state / "logs") == 0o700 and _mode(state / "bundles") == 0o700
    for name in ("controller.db", "controller.db-wal", "controller.db-shm"):
        assert _mode(state / name) == 0o600, name
    assert _mode(peer.key_dir / "peer.key") == 0o600 and _mode(peer.key_dir) == 0o700
    for log in (state / "logs").iterdir():
        assert _mode(log) & 0o077 == 0, log
    for workdir in (state / "work").iterdir():  # ended runs are handed back to the controller
        st = workdir.stat()
        assert _mode(workdir) == 0o700 and st.st_uid == os.geteuid(), workdir


async def test_job_environment_is_clean(peer: Peer) -> None:
    """Nothing of the controller's environment reaches the job but PATH and LANG."""
    out = await _run(peer, "import os, json; print(json.dumps(dict(os.environ)))", MY_VAR="mine")
    env = json.loads(out.strip().splitlines()[-1])
    assert SECRET not in env and SECRET_VALUE not in out
    extra = {k for k in env if not k.startswith("IRIS_")} - {
        "PATH",
        "LANG",
        "HOME",
        "CUDA_VISIBLE_DEVICES",
        "MY_VAR",
        "LC_CTYPE",  # set by the job's own python at start-up (PEP 538), not passed
    }
    assert not extra, extra
    assert env["MY_VAR"] == "mine"
    assert Path(env["HOME"]).parent == peer.state_dir / "work"


def test_unknown_run_as_is_one_config_error(tmp_path: Path) -> None:
    p = cluster("peer", backends=[cpu_backend()], run_as="no-such-iris-user")
    cfg = write_config(tmp_path / "clusters.toml", federation(cluster("home"), p))
    res = run_controller_cli(["--config", str(cfg), "--cluster", "peer", "--state-dir", str(tmp_path / "s")])
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "iris controller: cluster peer: run_as names an unknown user 'no-such-iris-user' on this host"
    ]
    assert not (tmp_path / "s").exists()


async def test_root_run_as_warns_once(tmp_path: Path) -> None:
    """A controller whose jobs keep its privileges says so once, at start-up."""
    p = cluster("peer", backends=[cpu_backend(), cpu_backend(id="cpu2")], run_as="root", sandbox="off")
    cfg = write_config(tmp_path / "clusters.toml", federation(cluster("home"), p))
    ctl = start_controller(cfg, "peer", tmp_path / "state", port=p["port"])
    try:
        warnings = [
            line
            for line in ctl.log_text().splitlines()
            if "jobs run with the controller's own privileges" in line
        ]
        assert len(warnings) == 1 and " WARNING " in warnings[0], ctl.log_text()
    finally:
        ctl.stop()
