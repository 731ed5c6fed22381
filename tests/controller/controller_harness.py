"""Real controller processes for tests: temp config files, free ports, readiness by polling."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from iris import devstack
from iris.config import FederationConfig
from iris.controller.client import ControllerClient
from iris.controller.identity import TokenSigner, generate_keypair, load_private_key
from iris.controller.models import JobStatus, LaunchRequest
from iris.policy.models import Band, DeviceRequest

PROJECT_ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


# Below the kernel's ephemeral range: no outgoing connection takes it before a controller binds it.
free_port = devstack.free_port


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(type(value))


def render_toml(config: dict[str, Any]) -> str:
    """TOML for the federation config shape (top-level scalars, [[clusters]] with backends/auth)."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in config.items() if k != "clusters"]
    for cluster in config["clusters"]:
        lines.append("\n[[clusters]]")
        for k, v in cluster.items():
            if k not in ("backends", "auth") or (k == "backends" and not v):
                lines.append(f"{k} = {_toml_value(v)}")
        for backend in cluster.get("backends", []):
            lines.append("\n[[clusters.backends]]")
            lines.extend(f"{k} = {_toml_value(v)}" for k, v in backend.items())
        if cluster.get("auth") is not None:
            lines.append("\n[clusters.auth]")
            lines.extend(f"{k} = {_toml_value(v)}" for k, v in cluster["auth"].items())
    return "\n".join(lines) + "\n"


def write_config(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(render_toml(config))
    FederationConfig.model_validate(config)  # fail the test early on a bad fixture
    return path


def gpu_backend(id: str = "gpu", slots: int = 16, cpu_slots: int = 4) -> dict[str, Any]:
    return {
        "id": id,
        "attributes": {"device-type": ["gpu"], "device-variant": ["h100"]},
        "devices": {"h100": slots},
        "cpu_slots": cpu_slots,
    }


def cpu_backend(id: str = "cpu", cpu_slots: int = 2) -> dict[str, Any]:
    return {"id": id, "attributes": {"device-type": ["cpu"]}, "cpu_slots": cpu_slots}


# A cluster's jobs run as in production: in the job sandbox (docs/SECURITY.md, "The job sandbox"),
# each as a pool uid under a root controller, seeing this test interpreter (bound read-only) but
# not the test's temp dir. run_as (the test's user) applies only where the host cannot sandbox.
# A test passes sandbox="off" where it is about the mechanics of unsandboxed jobs or inspects them
# from the host by means a sandbox changes (it says why);
# tests/controller/test_controller_privileges.py runs jobs as "nobody" for real.
TEST_USER = pwd.getpwuid(os.geteuid()).pw_name


def cluster(
    name: str,
    *,
    backends: list[dict[str, Any]] | None = None,
    auth: Any = None,
    run_as: str = TEST_USER,
    sandbox: str = "auto",
    rw_paths: list[Path] | None = None,
) -> dict[str, Any]:
    """One cluster's config; ``rw_paths``: its ``sandbox_rw_paths`` (see ``shared_dir``)."""
    c: dict[str, Any] = {
        "name": name,
        "port": free_port(),
        "backends": backends or [],
        "run_as": run_as,
        "sandbox": sandbox,
    }
    if rw_paths:
        c["sandbox_rw_paths"] = [str(p) for p in rw_paths]
    if auth is not None:
        c["auth"] = auth
    return c


def shared_dir(path: Path) -> Path:
    """``path`` (created) as a directory a test shares with its jobs: markers, gate and slot files.
    In a cluster's ``sandbox_rw_paths`` (``cluster(rw_paths=...)``) every sandboxed job sees it at
    this path; mode 1777, so each job's pool uid writes there and removes only its own files. Keep
    it out of a controller's state dir and its parent (the default key dir): the controller refuses
    an overlap at start. A file several jobs (several uids) append to is made by the test, 0666."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o1777)
    return path


async def sandboxed(ctl: Controller, signer: TokenSigner | None = None) -> bool:
    """Whether the controller's process backends run their jobs in the bwrap sandbox (its capacity
    report says so): a test whose assertions differ with and without it asks this, never assumes."""
    async with ctl.client(signer) as c:
        reports = (await c.backends()).backends
    return all((b.sandbox or "").startswith("bwrap") for b in reports)


def job_pids(job_id: str) -> set[int]:
    """The host pids of the job's processes (their environment names the job, IRIS_JOB_ID): seen
    from the host with and without the sandbox (a sandboxed job only knows its namespace's pids)."""
    wanted = f"IRIS_JOB_ID={job_id}".encode()
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if wanted in (entry / "environ").read_bytes().split(b"\0"):
                found.add(int(entry.name))
    return found


def federation(*clusters: dict[str, Any]) -> dict[str, Any]:
    return {"home": clusters[0]["name"], "clusters": list(clusters)}


def key_auth(name: str, **extra: Any) -> dict[str, Any]:
    return {"private_key_file": f"{name}.key", "public_key_file": f"{name}.pub", **extra}


@dataclass
class Controller:
    """One ``python -m iris.controller`` process."""

    cluster: str
    url: str
    port: int
    config_path: Path
    state_dir: Path
    log_path: Path
    key_dir: Path | None
    proc: subprocess.Popen[bytes]
    extra_args: list[str] = field(default_factory=list)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def client(self, signer: TokenSigner | None = None, timeout: float = 10.0) -> ControllerClient:
        return ControllerClient(self.url, signer=signer, audience=self.cluster, timeout=timeout)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


def run_controller_cli(args: list[str], *, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "iris.controller", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=PROJECT_ROOT,
    )


def start_controller(
    config_path: Path,
    cluster_name: str,
    state_dir: Path,
    *,
    port: int,
    key_dir: Path | None = None,
    kill_grace: float = 1.0,
    ready_timeout: float = 30.0,
    env: dict[str, str] | None = None,
) -> Controller:
    state_dir.mkdir(parents=True, exist_ok=True)
    log_path = state_dir.parent / f"{state_dir.name}.controller.log"
    args = [
        "--config",
        str(config_path),
        "--cluster",
        cluster_name,
        "--state-dir",
        str(state_dir),
        "--port",
        str(port),
        "--kill-grace",
        str(kill_grace),
    ]
    if key_dir is not None:
        args += ["--key-dir", str(key_dir)]
    with log_path.open("ab") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "iris.controller", *args],
            stdout=logf,
            stderr=subprocess.STDOUT,
            cwd=PROJECT_ROOT,
            env={**os.environ, **(env or {})},
        )
    ctl = Controller(
        cluster=cluster_name,
        url=f"http://127.0.0.1:{port}",
        port=port,
        config_path=config_path,
        state_dir=state_dir,
        log_path=log_path,
        key_dir=key_dir,
        proc=proc,
        extra_args=args,
    )
    wait_ready(ctl, ready_timeout)
    return ctl


def wait_ready(ctl: Controller, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if ctl.proc.poll() is not None:
            raise RuntimeError(
                f"controller {ctl.cluster} exited with {ctl.proc.returncode}:\n{ctl.log_text()}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{ctl.url}/v1/health", timeout=1.0).status_code == 200:
                return
        if time.monotonic() > deadline:
            ctl.proc.kill()
            raise TimeoutError(f"controller {ctl.cluster} not ready after {timeout}s:\n{ctl.log_text()}")
        time.sleep(0.05)


def restart(ctl: Controller, ready_timeout: float = 30.0) -> Controller:
    """A new process on the same config, state dir and port."""
    with ctl.log_path.open("ab") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "iris.controller", *ctl.extra_args],
            stdout=logf,
            stderr=subprocess.STDOUT,
            cwd=PROJECT_ROOT,
        )
    new = Controller(**{**ctl.__dict__, "proc": proc})
    try:
        wait_ready(new, ready_timeout)
    except BaseException:
        # The caller still holds the old handle: stop the new process here, or it outlives the test.
        new.stop()
        raise
    return new


def read_by_server(server_port: int, client_port: int) -> bool:
    """Whether the process listening on 127.0.0.1:``server_port`` has accepted the connection from
    ``client_port`` and read every byte sent on it: the server side's socket in ``/proc/net/tcp``
    has an owner (inode 0 = not accepted yet) and an empty receive queue (Linux)."""
    server, client = f"0100007F:{server_port:04X}", f"0100007F:{client_port:04X}"
    with open("/proc/net/tcp") as table:
        for row in table.read().splitlines()[1:]:
            fields = row.split()
            if fields[1] == server and fields[2] == client:
                received = int(fields[4].split(":")[1], 16)
                return fields[9] != "0" and received == 0
    return False


class HeldRequest:
    """One HTTP/1.1 request on its own connection, answered later: a long poll, or a request a
    lock holds. ``in_hands`` tells when the controller has read it (it is then the controller's,
    and the request itself is waiting; no sleep needed to let it arrive), ``done`` whether the
    answer has come (the controller closes the connection after it)."""

    def __init__(self, ctl: Controller, path: str, headers: dict[str, str] | None = None) -> None:
        self.ctl = ctl
        self.path = path
        self.headers = headers or {}
        self.client_port = 0
        self._answer: asyncio.Task[bytes] | None = None

    async def send(self) -> HeldRequest:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.ctl.port)
        self.client_port = writer.get_extra_info("sockname")[1]
        head = {"Host": f"127.0.0.1:{self.ctl.port}", "Connection": "close", **self.headers}
        lines = [f"GET {self.path} HTTP/1.1", *(f"{k}: {v}" for k, v in head.items()), "", ""]
        writer.write("\r\n".join(lines).encode())
        await writer.drain()

        async def answer() -> bytes:
            try:
                return await reader.read()
            finally:
                writer.close()

        self._answer = asyncio.create_task(answer())
        return self

    async def in_hands(self) -> bool:
        return read_by_server(self.ctl.port, self.client_port)

    def done(self) -> bool:
        return self._answer is not None and self._answer.done()

    async def response(self) -> tuple[int, bytes]:
        """The answer's status and body (read to the end of the connection)."""
        assert self._answer is not None, "send() first"
        raw = await self._answer
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 "), raw[:200]
        return int(head.split()[1]), body


async def poll(
    fn: Callable[[], Awaitable[T]],
    until: Callable[[T], bool],
    *,
    timeout: float = 20.0,
    interval: float = 0.05,
    what: str = "condition",
) -> T:
    """Call ``fn`` until ``until(result)`` holds; fail with the last result after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await fn()
        if until(value):
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {value!r}")
        await asyncio.sleep(interval)


async def wait_terminal(client: ControllerClient, job_id: str, timeout: float = 20.0) -> JobStatus:
    return await poll(
        lambda: client.status(job_id), lambda s: s.terminal, timeout=timeout, what=f"{job_id} terminal"
    )


async def read_all_logs(client: ControllerClient, job_id: str, timeout: float = 20.0) -> str:
    """Read the log to eof (the job must end within ``timeout``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    out, offset = [], 0
    while True:
        chunk = await client.logs(job_id, offset, follow=True, wait_s=2.0)
        out.append(chunk.data)
        offset = chunk.next_offset
        if chunk.eof:
            return "".join(out)
        if loop.time() > deadline:
            raise AssertionError(f"log of {job_id} not at eof after {timeout}s: {''.join(out)!r}")


_counter = 0


def request(
    command: list[str],
    *,
    job_id: str | None = None,
    backend_id: str = "gpu",
    gpus: int = 0,
    replicas: int = 1,
    band: Band = Band.INTERACTIVE,
    requester: str = "home",
    user: str = "alice@example.com",
    nonce: str = "n1",
    timeout_s: float | None = None,
    env: dict[str, str] | None = None,
) -> LaunchRequest:
    global _counter
    _counter += 1
    device = (
        DeviceRequest(type="gpu", variant="h100", count=gpus, replicas=replicas)
        if gpus
        else DeviceRequest(replicas=replicas)
    )
    return LaunchRequest(
        job_id=job_id or f"test/job-{os.getpid()}-{_counter}",
        command=command,
        env=env or {},
        device=device,
        band=band,
        user=user,
        requester=requester,
        nonce=nonce,
        backend_id=backend_id,
        timeout_s=timeout_s,
    )


def make_keys(key_dir: Path, *names: str) -> None:
    for name in names:
        generate_keypair(key_dir, name)


def signer_for(config_path: Path, name: str, key_dir: Path) -> TokenSigner:
    from iris.config import load_config

    config = load_config(config_path)
    return TokenSigner(name, load_private_key(config.cluster(name), key_dir))


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def process_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "zombie" not in status.lower()


def world_python() -> str:
    """A python3 that ``nobody`` can execute (every directory on its path world-searchable); the
    test is skipped where there is none."""
    found = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if found is None:
        pytest.skip("no system python3 for the unprivileged job")
    real = Path(found).resolve()
    for part in [real, *real.parents]:
        if not part.stat().st_mode & stat.S_IXOTH:
            pytest.skip(f"{real} is not executable by others")
    return str(real)
