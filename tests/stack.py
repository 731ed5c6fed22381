"""The real embedded stack for tests: Temporal dev server, emulators, controllers and a worker.

Started once per test session by ``tests/conftest.py``; every service is the real one, on free
loopback ports, with the demo topology of ``config/clusters.toml`` — or, with ``backend="ray"``, of
``config/clusters-ray.toml``: the same clusters with the GPU peers' backends on one real local Ray
head, started and stopped with the stack (as ``iris dev --ray`` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from faultproxy import FaultProxy
from rayhead import on_ray_head
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from iris import devstack
from iris.client import AsyncIrisClient, current_user
from iris.config import FederationConfig, load_config, store_url
from iris.contract import SEARCH_ATTRIBUTE_KEYS
from iris.controller.identity import KEY_DIR_ENV
from iris.keydirs import provision_key_dirs
from iris.slurmdev import SlurmCluster, point_at
from iris.store import FederationStore
from iris.temporal import data_converter
from iris.userauth import USER_KEY_DIR_ENV, register_user
from worker.main import build_worker, ensure_manager

VENV_BIN = Path(sys.executable).parent
PROJECT_ROOT = Path(__file__).resolve().parents[1]

Backend = Literal["process", "ray", "slurm"]
# Who the suite submits as (the SDK's default, the CLI's IRIS_USER and the users tests name), and
# their roles; `Stack.add_user` registers more.
TEST_USERS: dict[str, list[str]] = {
    current_user(): ["admin"],
    "tester@example.com": ["admin"],
    "alice": ["user"],
    "alice@example.com": ["user"],
    "alice@allowed.example": ["user"],
    "eve@evil.example": ["user"],
    "race@example.com": ["user"],
    "pace@example.com": ["user"],
    "ops@example.com": ["user"],
    "recorder@example.com": ["user"],  # scripts/record_histories.py
    # A peer refuses this name whoever signs it (tests/security/test_security_admission.py).
    "local_admin": ["user"],
}
# The topology of each backend choice: the same clusters, backends and ports; with "ray" the GPU
# peers' backends run their jobs on Ray.
CONFIGS: dict[str, Path] = {
    "process": PROJECT_ROOT / "config" / "clusters.toml",
    "ray": PROJECT_ROOT / "config" / "clusters-ray.toml",
    # The GPU peers on a single-node Slurm of the test process's (tests/slurm/conftest.py).
    "slurm": PROJECT_ROOT / "config" / "clusters-slurm.toml",
}


def free_port_config(
    base: FederationConfig, temporal_address: str, shared_dir: Path | None = None
) -> FederationConfig:
    """The demo topology on free ports, so tests never collide with a running `iris dev`.

    Its jobs run as the config says: in the job sandbox (``auto``, a pool uid each under a root
    controller; docs/SECURITY.md, "The job sandbox"), so the suite sees what the sandbox changes.
    ``shared_dir`` (an existing directory) joins every cluster's ``sandbox_rw_paths``: where the
    jobs of a test leave what the test, or the job's next attempt, reads back."""
    cfg = base.model_copy(deep=True)
    cfg.temporal.address = temporal_address
    cfg.temporal.task_queue = "iris-test"
    cfg.temporal.ui_port = devstack.free_port()
    cfg.s3_port = devstack.free_port()
    cfg.gcs_port = devstack.free_port()
    # Short handoff timers (docs/DESIGN.md, "Errors, retries and parking"): the launch's 6 tries
    # span 0.5 + 1 + 2 + 4 + 4 = 11.5 s (25 s by default), still longer than a controller's restart
    # on a loaded machine (3-8 s measured; tests/e2e/test_bundles.py restarts one under a launch),
    # and a park whose launch went unanswered asks its cluster after 1 s, then every 2 s.
    cfg.handoff_retry_initial_s = 0.5
    cfg.handoff_retry_max_s = 4.0
    cfg.parked_probe_first_s = 1.0
    cfg.parked_probe_max_s = 2.0
    for c in cfg.clusters:
        c.port = devstack.free_port()
        if shared_dir is not None:
            c.sandbox_rw_paths = [*c.sandbox_rw_paths, str(shared_dir)]
        if c.object_store is not None:
            port = cfg.s3_port if c.object_store.kind == "s3" else cfg.gcs_port
            c.object_store.endpoint = f"http://127.0.0.1:{port}"
    return cfg


# A job the test federation can hold, but not while ``Stack.holding()`` runs: 16 H100 on one backend
# (2 × 8), which only cw-us-east-02a's 16 hold. A job larger than every backend of its shape is
# rejected at submit (docs/DESIGN.md, "Never fits"), so a test that needs a job to wait gives it this
# shape and keeps one of that backend's chips busy meanwhile.
WAITS: dict[str, Any] = {"device_type": "h100", "gpu_count": 8, "replicas": 2}
WAITS_ARGS = ("--device-type", "h100", "--gpu-count", "8", "--replicas", "2")
HELD_CLUSTER = "cw-us-east-02a"


class StackClient(AsyncIrisClient):
    """The SDK as the suite uses it: a job ships no workspace unless its test passes ``workdir``.
    The suite runs in the repository, which is not what most tests' jobs are about; the tests of
    workspace bundles (tests/e2e/test_bundles.py) build their own directories."""

    async def submit(
        self,
        command: Sequence[str] | None = None,
        *,
        script: str | None = None,
        workdir: str | os.PathLike[str] | None = None,
        **kw: Any,
    ) -> str:
        return await super().submit(command, script=script, workdir=workdir, **kw)


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str


@dataclass
class Stack:
    config: FederationConfig
    config_file: Path
    data_dir: Path
    key_dir: Path  # the home worker's (the home cluster's) key directory
    key_dirs: dict[str, Path]  # each cluster's own
    client: Client
    iris: AsyncIrisClient
    store: FederationStore
    # A directory every job of the stack reads and writes at this path (each cluster's
    # sandbox_rw_paths; mode 1777): markers and gate files a test shares with its jobs, and state
    # a job's attempts pass on. A test's own tmp_path is out of its jobs' sight.
    shared_dir: Path
    backend: Backend = "process"
    services: dict[str, devstack.ManagedProcess] = field(default_factory=dict)
    proxies: dict[str, FaultProxy] = field(default_factory=dict)
    # Response bodies tests received from this stack's services, for the secret scan at its
    # teardown (tests/secret_scan.py).
    responses: list[str] = field(default_factory=list)

    def put_artifact(self, bucket: str, key: str, data: bytes = b"shard") -> None:
        """Put an object into an S3 bucket of the emulator, with the emulator's own test
        credentials: not any cluster's (the test process holds none of the peers')."""
        import boto3

        s3 = boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{self.config.s3_port}",
            region_name="us-east-1",
            aws_access_key_id="test",
            aws_secret_access_key="test",
        )
        s3.put_object(Bucket=bucket, Key=key, Body=data)

    def add_user(self, user: str, roles: list[str]) -> Path:
        """Give ``user`` a signing key and register it (the worker reads the config's users live);
        returns the key file."""
        path, _, _ = register_user(self.config, user, roles)
        return path

    @contextlib.asynccontextmanager
    async def holding(self, cluster: str = HELD_CLUSTER, gpus: int = 1) -> AsyncIterator[str]:
        """A job holding ``gpus`` H100 of ``cluster`` (RUNNING when this yields its id), cancelled and
        ended on the way out: the capacity is free again for the next test."""
        from iris.jobs import JobState

        job_id = await self.iris.submit(
            ["sleep", "3600"],
            name=f"holder-{uuid.uuid4().hex[:8]}",
            target_cluster=cluster,
            device_type="h100",
            gpu_count=gpus,
        )
        try:

            async def running() -> bool:
                st = await self.iris.describe(job_id)
                assert not st.terminal, f"the holder {job_id} ended: {st.state} {st.reason}"
                return st.state is JobState.RUNNING

            await wait_until(running, timeout=90, what=f"the holder {job_id} to run on {cluster}")
            yield job_id
        finally:
            await self.iris.cancel(job_id)
            await self.iris.wait(job_id, timeout_s=60)

    def cli_env(self) -> dict[str, str]:
        return {**os.environ, "IRIS_CONFIG": str(self.config_file), "IRIS_USER": "tester@example.com"}

    async def cli(self, *args: str, timeout: float = 120.0, cwd: Path | None = None) -> CliResult:
        """Run `iris ARGS...` as a user would, without blocking the worker sharing this loop.

        In ``cwd``, by default an empty directory: the workspace `iris job run` ships is empty.
        """
        if cwd is None:
            cwd = self.data_dir / "empty-cwd"
            cwd.mkdir(exist_ok=True)
        proc = await asyncio.create_subprocess_exec(
            str(VENV_BIN / "iris"),
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self.cli_env(),
            cwd=cwd,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
        return CliResult(proc.returncode or 0, out.decode(), err.decode())


async def wait_until(
    predicate: Callable[[], Awaitable[bool]], *, timeout: float = 30.0, interval: float = 0.1, what: str = ""
) -> None:
    """Poll ``predicate`` until true; fail the test with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")


class StackRunner:
    """Starts and stops one stack of the session.

    ``backend`` chooses where the GPU peers run their jobs: ``"process"`` (``config/clusters.toml``)
    or ``"ray"`` (``config/clusters-ray.toml`` on ``ray_head``, the test process's one Ray head,
    tests/rayhead.py).
    ``key_dir`` holds one key directory per cluster (iris/keydirs.py); stacks sharing one test
    process must share it, since the worker's activities read the home cluster's directory from
    ``$IRIS_KEY_DIR`` at each call.
    """

    def __init__(
        self,
        root: Path,
        backend: Backend = "process",
        *,
        key_dir: Path | None = None,
        ray_head: devstack.RayHeadSpec | None = None,
        slurm: SlurmCluster | None = None,
    ) -> None:
        if (backend == "ray") != (ray_head is not None):
            raise ValueError("a Ray-backed stack needs the session's Ray head, and only it does")
        if (backend == "slurm") != (slurm is not None):
            raise ValueError("a Slurm-backed stack needs a running Slurm, and only it does")
        self.slurm = slurm
        self.root = root
        self.backend = backend
        self.key_dir = key_dir or root / "keys"
        self.ray_head = ray_head
        self.env: WorkflowEnvironment | None = None
        self.worker: Worker | None = None
        self.worker_task: asyncio.Task[None] | None = None
        self.services: list[devstack.ManagedProcess] = []
        self.store: FederationStore | None = None
        self.proxies: dict[str, FaultProxy] = {}

    async def start(self) -> Stack:
        base = load_config(CONFIGS[self.backend])
        if self.ray_head is not None:
            # Both peers on the session's head, their resources named per peer (as in `iris dev --ray`).
            on_ray_head(base, self.ray_head)
        if self.slurm is not None:
            # The GPU peers' backends on that Slurm (its slurm.conf, its job directory).
            point_at(base, self.slurm)
        self.ui_port = devstack.free_port()
        self.env = await WorkflowEnvironment.start_local(
            ui=True,
            ui_port=self.ui_port,
            dev_server_existing_path=str(devstack.venv_bin("temporal")),
            search_attributes=SEARCH_ATTRIBUTE_KEYS,
            data_converter=data_converter(),
            dev_server_startup_timeout=timedelta(seconds=60),
        )
        address = self.env.client.service_client.config.target_host
        shared_dir = self.root / "shared"
        shared_dir.mkdir(exist_ok=True)
        shared_dir.chmod(0o1777)  # the jobs' pool uids write there; the sticky bit keeps their files theirs
        cfg = free_port_config(base, address, shared_dir)
        cfg.temporal.ui_port = self.ui_port
        config_file = self.root / "clusters.json"
        # The users the suite submits as, each with a signing key (iris/userauth.py), registered
        # in this config: the worker verifies every submission, cancel and replay against it.
        # One user key directory per test process (like the cluster keys): this process signs for
        # every stack it runs, so each registers the same keys.
        users = self.key_dir.with_name(self.key_dir.name + "-users")
        os.environ.setdefault(USER_KEY_DIR_ENV, str(users))
        for user, roles in TEST_USERS.items():
            register_user(cfg, user, roles)
        config_file.write_text(cfg.model_dump_json(indent=2))
        # This process hosts the worker: the home cluster's credentials only (each controller
        # gets its own from devstack.controller).
        os.environ.update(devstack.store_credentials(cfg, cfg.home))
        # One key directory per cluster (iris/keydirs.py): this process, the home worker, reads the
        # home one; each controller only its own.
        key_dirs = provision_key_dirs(cfg, self.key_dir)
        key_dir = key_dirs.of(cfg.home)
        os.environ[KEY_DIR_ENV] = str(key_dir)
        # Each controller listens on an internal port; the federation reaches it through a fault
        # proxy on the configured port, so tests can inject an outage at the moment of handoff.
        internal = {c.name: devstack.free_port() for c in cfg.clusters}
        services = [
            devstack.s3_server(cfg, self.root),
            devstack.gcs_server(cfg, self.root),
            *(
                devstack.controller(
                    config_file, cfg, c.name, self.root, port=internal[c.name], key_dir=key_dirs.of(c.name)
                )
                for c in cfg.clusters
            ),
        ]
        for svc in services:
            svc.start()
            self.services.append(svc)
        for svc in services:
            await asyncio.to_thread(svc.wait_ready, 60)
        for c in cfg.clusters:
            proxy = FaultProxy(f"http://127.0.0.1:{internal[c.name]}")
            await proxy.start(c.port)
            self.proxies[c.name] = proxy
        await asyncio.to_thread(devstack.ensure_buckets, cfg)
        self.store = FederationStore(store_url(cfg, self.root))
        self.worker = build_worker(self.env.client, cfg, self.store)
        self.worker_task = asyncio.create_task(self.worker.run())
        await ensure_manager(self.env.client, cfg)
        return Stack(
            config=cfg,
            config_file=config_file,
            data_dir=self.root,
            key_dir=key_dir,
            key_dirs=dict(key_dirs.dirs),
            client=self.env.client,
            iris=StackClient(self.env.client, cfg),
            store=self.store,
            shared_dir=shared_dir,
            backend=self.backend,
            services={s.name: s for s in services},
            proxies=self.proxies,
        )

    async def stop(self) -> None:
        if self.worker is not None:
            await self.worker.shutdown()
        if self.worker_task is not None:
            await asyncio.gather(self.worker_task, return_exceptions=True)
        for proxy in self.proxies.values():
            await proxy.stop()
        for svc in reversed(self.services):
            await asyncio.to_thread(svc.stop)
        if self.store is not None:
            self.store.close()
        if self.env is not None:
            await self.env.shutdown()
