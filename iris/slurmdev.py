"""A single-node Slurm of one's own, for ``iris dev --backend slurm`` and the Slurm tests
(docs/DESIGN.md, "The Slurm backend").

Debian 12's packages (``slurmctld slurmd slurm-client munge``, Slurm 22.05) run it as root from a
directory of its own: ``munged`` with its own key and socket, then ``slurmctld``, and ``slurmd`` only
once ``scontrol ping`` says the controller is UP (a slurmd started first backs off its registration
for 38 s or more). Its ports are free ones, so several such clusters (and a system Slurm) coexist.

- The one node declares more CPUs than the host has (``SlurmdParameters=config_overrides``) and
  GPUs of each GRES type asked for, simulated: ``gres.conf`` names device files that are links to
  ``/dev/null``, and Slurm then sets ``CUDA_VISIBLE_DEVICES`` for a job as on real GPUs. Several
  users of one such cluster keep their GPUs apart by GRES type, as users of one Ray head keep
  theirs apart by resource name.
- ``MinJobAge=3600``: without slurmdbd, a finished job stays visible to ``squeue`` for an hour.
- ``SlurmdTimeout`` is short (10 s): a slurmd that dies has its node marked down and its jobs
  ``NODE_FAIL`` within about half a minute.
- The daemons start from a minimal environment: the caller's (a worker's credentials, its key
  directory) never reaches Slurm, nor, through it, a job.
- The jobs' working directories go to a directory every job's user can reach (``work_dir``, under
  ``/tmp``), since the data directory is its owner's alone.

``stop`` cancels every job first (``slurmstepd`` outlives slurmd), then stops slurmd, slurmctld and
munged, and kills whatever still carries this cluster's ``SLURM_CONF`` in its environment.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from iris.config import FederationConfig
from iris.devstack import ManagedProcess, ServiceError, free_port

# Where Debian puts the daemons (root's PATH has /usr/sbin; another user's may not).
_SBIN = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
# The commands each package provides, for a one-line "install these" message.
_PACKAGES = {
    "munged": "munge",
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "sbatch": "slurm-client",
    "squeue": "slurm-client",
    "scancel": "slurm-client",
    "scontrol": "slurm-client",
    "sinfo": "slurm-client",
}
INSTALL_HINT = "apt-get install -y slurmctld slurmd slurm-client munge"
# The daemons start from these variables of the caller's only.
_ENV_PASSTHROUGH = ("LANG", "LC_ALL", "TZ")
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
NODE = "node1"
DEFAULT_PARTITION = "iris"


def command(name: str) -> str | None:
    """The path of one of Slurm's or munge's commands, or None."""
    found = shutil.which(name)
    if found is not None:
        return found
    for directory in _SBIN:
        path = Path(directory) / name
        if path.exists():
            return str(path)
    return None


def missing_packages() -> list[str]:
    """The Debian packages a local Slurm needs that are not installed."""
    return sorted({pkg for cmd, pkg in _PACKAGES.items() if command(cmd) is None})


def unavailable() -> str | None:
    """Why this host cannot run a local Slurm (one line), or None."""
    missing = missing_packages()
    if missing:
        return f"Slurm is not installed (missing {', '.join(missing)}): {INSTALL_HINT}"
    if os.geteuid() != 0:
        return "a local Slurm runs its daemons as root (SlurmUser=root, slurmd switches to each job's user)"
    return None


@dataclass(frozen=True)
class SlurmSpec:
    """One single-node Slurm: its ports, the GPUs of each GRES type its node has, its partitions
    (all on the node; the first is the default)."""

    gres: dict[str, int]
    ctld_port: int = field(default_factory=free_port)
    slurmd_port: int = field(default_factory=free_port)
    partitions: tuple[str, ...] = (DEFAULT_PARTITION,)
    cpus: int = 64
    memory_mb: int = 64_000
    name: str = "iris"
    # How long a silent slurmd has before its node is down and its jobs NODE_FAIL.
    slurmd_timeout_s: int = 10
    # Between the SIGTERM and the SIGKILL of a job Slurm ends (KillWait; slurmd waits at least 5 s).
    kill_wait_s: int = 5


def spec_for(config: FederationConfig) -> SlurmSpec | None:
    """The one local Slurm a config's Slurm backends share (``iris dev --backend slurm``): the GPUs
    of every GRES type they name (backends naming one type share it) and their partitions."""
    gres: dict[str, int] = {}
    partitions: list[str] = []
    found = False
    for c in config.clusters:
        for b in c.backends:
            if b.kind != "slurm":
                continue
            found = True
            for token, count in b.devices.items():
                gres_type = b.slurm_gres_type(token) or token
                gres[gres_type] = max(gres.get(gres_type, 0), count)
            for p in [b.slurm_partition, *b.slurm_partitions.values()]:
                if p not in partitions:
                    partitions.append(p)
    if not found:
        return None
    return SlurmSpec(gres=gres, partitions=tuple(partitions or [DEFAULT_PARTITION]))


def _runtime_dir(root: Path) -> Path:
    """Sockets, the spool and the jobs' working directories: a short path under /tmp of this
    cluster's own (Unix socket paths stay under 108 bytes; every job's user can reach it)."""
    digest = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"iris-slurm-{digest}"


def slurm_conf(spec: SlurmSpec, root: Path, runtime: Path) -> str:
    gres = ",".join(f"gpu:{t}:{n}" for t, n in spec.gres.items() if n > 0)
    lines = [
        "# Written by iris/slurmdev.py (docs/DESIGN.md, 'The Slurm backend').",
        f"ClusterName={spec.name}",
        "SlurmctldHost=localhost(127.0.0.1)",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={runtime / 'munge.socket'}",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"SlurmctldPort={spec.ctld_port}",
        f"SlurmdPort={spec.slurmd_port}",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={runtime / 'spool'}",
        f"SlurmctldPidFile={runtime / 'slurmctld.pid'}",
        f"SlurmdPidFile={runtime / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'logs' / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'logs' / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "MpiDefault=none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SchedulerType=sched/backfill",
        "SlurmdParameters=config_overrides",
        "MailProg=/bin/true",
        "MinJobAge=3600",
        "ReturnToService=2",
        f"SlurmdTimeout={spec.slurmd_timeout_s}",
        f"KillWait={spec.kill_wait_s}",
        "GresTypes=gpu",
        f"NodeName={NODE} NodeAddr=127.0.0.1 CPUs={spec.cpus} RealMemory={spec.memory_mb}"
        + (f" Gres={gres}" if gres else "")
        + " State=UNKNOWN",
    ]
    for i, partition in enumerate(spec.partitions):
        default = "YES" if i == 0 else "NO"
        lines.append(f"PartitionName={partition} Nodes={NODE} Default={default} MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def gres_conf(spec: SlurmSpec, devices: Path) -> str:
    lines = ["AutoDetect=off"]
    first = 0
    for gres_type, count in spec.gres.items():
        if count <= 0:
            continue
        files = f"{devices}/nvidia[{first}-{first + count - 1}]" if count > 1 else f"{devices}/nvidia{first}"
        lines.append(f"NodeName={NODE} Name=gpu Type={gres_type} File={files}")
        first += count
    return "\n".join(lines) + "\n"


class SlurmCluster:
    """One single-node Slurm: its state, logs and munge key under ``root``; its configuration,
    sockets, spool and job directories under a short runtime directory in /tmp (every job's user
    reads the configuration and reaches its own directory there)."""

    def __init__(self, spec: SlurmSpec, root: Path) -> None:
        self.spec = spec
        self.root = Path(os.path.abspath(root))
        self.runtime = _runtime_dir(self.root)
        # Readable by every job's user (srun reads it on the node), as /etc/slurm is on a cluster;
        # it holds no secret (the munge key stays in ``root``).
        self.conf = self.runtime / "slurm.conf"
        # Where a Slurm backend on this cluster keeps its jobs' directories (slurm_work_dir).
        self.work_dir = self.runtime / "work"
        # Tools its jobs find on their PATH: ``python`` (Debian's python3; this project's own
        # interpreter may sit where a job's user cannot reach it).
        self.bin_dir = self.runtime / "bin"
        self.name = "Slurm"
        self.address = f"slurmctld 127.0.0.1:{spec.ctld_port}, slurmd {NODE} 127.0.0.1:{spec.slurmd_port}"
        self.munged: ManagedProcess | None = None
        self.slurmctld: ManagedProcess | None = None
        self.slurmd: ManagedProcess | None = None

    @property
    def job_path(self) -> str:
        """The PATH its jobs get: its tools, then the system's."""
        return f"{self.bin_dir}:{_SYSTEM_PATH}"

    @property
    def env(self) -> dict[str, str]:
        """What a Slurm command needs to talk to this cluster."""
        return {"SLURM_CONF": str(self.conf), "PATH": _PATH, "LANG": "C.UTF-8"}

    def _daemon_env(self) -> dict[str, str]:
        env = {k: os.environ[k] for k in _ENV_PASSTHROUGH if k in os.environ}
        return {**env, **self.env, "HOME": str(self.root)}

    def _process(self, name: str, argv: Sequence[str], ready: Callable[[], bool]) -> ManagedProcess:
        return ManagedProcess(
            name=name,
            argv=["/usr/bin/env", "-i", *(f"{k}={v}" for k, v in self._daemon_env().items()), *argv],
            log_path=self.root / "logs" / f"{name}.out",
            ready=ready,
            address="",
        )

    def write(self) -> None:
        """The configuration, the munge key, the simulated GPUs and the directories."""
        for path in (self.root, self.root / "state", self.root / "logs"):
            path.mkdir(parents=True, exist_ok=True)
            os.chmod(path, 0o700)
        self.runtime.mkdir(mode=0o711, exist_ok=True)
        os.chmod(self.runtime, 0o711)
        for path in (self.runtime / "spool", self.runtime / "dev", self.runtime / "munge"):
            path.mkdir(mode=0o700, exist_ok=True)
        self.work_dir.mkdir(mode=0o711, exist_ok=True)
        os.chmod(self.work_dir, 0o711)
        self.bin_dir.mkdir(mode=0o755, exist_ok=True)
        os.chmod(self.bin_dir, 0o755)
        python = self.bin_dir / "python"
        if not python.is_symlink():
            python.symlink_to(shutil.which("python3", path=_SYSTEM_PATH) or "/usr/bin/python3")
        # The device files Slurm hands out: links to /dev/null, as many as the node has GPUs.
        devices = self.runtime / "dev"
        total = sum(n for n in self.spec.gres.values() if n > 0)
        for i in range(total):
            link = devices / f"nvidia{i}"
            if not link.is_symlink():
                link.symlink_to("/dev/null")
        key = self.root / "munge.key"
        if not key.exists():
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(1024))
        # gres.conf sits beside slurm.conf, where Slurm looks for it.
        for path, text in (
            (self.conf, slurm_conf(self.spec, self.root, self.runtime)),
            (self.runtime / "gres.conf", gres_conf(self.spec, devices)),
        ):
            path.write_text(text)
            os.chmod(path, 0o644)

    def _command(self, name: str) -> str:
        path = command(name)
        if path is None:
            raise ServiceError(f"{name} not found: {INSTALL_HINT}")
        return path

    def run(self, *argv: str, timeout: float = 30.0, check: bool = False) -> subprocess.CompletedProcess[str]:
        """One Slurm command against this cluster."""
        return subprocess.run(
            [self._command(argv[0]), *argv[1:]],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
        )

    def controller_up(self) -> bool:
        try:
            return "is UP" in self.run("scontrol", "ping", timeout=10).stdout
        except subprocess.TimeoutExpired:
            return False

    def node_state(self) -> str:
        """The node's state as ``sinfo`` says it (e.g. ``idle``, ``mixed``, ``down*``)."""
        try:
            result = self.run("sinfo", "--json", timeout=10)
            nodes = json.loads(result.stdout).get("nodes") or []
        except (subprocess.TimeoutExpired, json.JSONDecodeError):
            return ""
        if not nodes:
            return ""
        node = nodes[0]
        flags = node.get("state_flags") or []
        return str(node.get("state", "")).lower() + ("*" if "NOT_RESPONDING" in flags else "")

    def node_up(self) -> bool:
        return self.node_state() in ("idle", "mixed", "allocated")

    def start(self, timeout: float = 60.0) -> None:
        """Start munged, slurmctld, and slurmd once slurmctld answers; return when the node is up.
        A start that fails (or is interrupted) stops whatever of it had started before raising."""
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> None:
        self.write()
        socket = self.runtime / "munge.socket"
        self.munged = self._process(
            "munged",
            [
                self._command("munged"),
                "-F",
                "--force",
                f"--socket={socket}",
                f"--key-file={self.root / 'munge.key'}",
                f"--pid-file={self.runtime / 'munge' / 'munged.pid'}",
                f"--seed-file={self.runtime / 'munge' / 'munged.seed'}",
                f"--log-file={self.root / 'logs' / 'munged.log'}",
            ],
            socket.exists,
        )
        self.munged.start()
        self.munged.wait_ready(timeout)
        self.slurmctld = self._process(
            "slurmctld", [self._command("slurmctld"), "-D", "-c", "-f", str(self.conf)], self.controller_up
        )
        self.slurmctld.start()
        self.slurmctld.wait_ready(timeout)
        self.start_slurmd(timeout)

    def start_slurmd(self, timeout: float = 60.0) -> None:
        """(Re)start slurmd; return once the node is up (a restarted slurmd also ends the steps of
        jobs Slurm has since ended: a node that came back)."""
        self.slurmd = self._process(
            "slurmd", [self._command("slurmd"), "-D", "-N", NODE, "-f", str(self.conf)], self.node_up
        )
        self.slurmd.start()
        self.slurmd.wait_ready(timeout)

    def kill_slurmd(self) -> None:
        """SIGKILL slurmd alone (its jobs' slurmstepd processes live on, as on a real node)."""
        if self.slurmd is not None and self.slurmd.proc is not None:
            self.slurmd.proc.kill()
            self.slurmd.proc.wait(timeout=10)

    def job_ids(self, *, live_only: bool = True) -> list[int]:
        """Every job Slurm holds (only those not finished, by default)."""
        result = self.run("squeue", "--json", timeout=20)
        if result.returncode != 0:
            return []
        jobs = json.loads(result.stdout).get("jobs") or []
        finished = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL"}
        finished |= {"DEADLINE", "OUT_OF_MEMORY", "REVOKED"}
        return [int(j["job_id"]) for j in jobs if not live_only or str(j.get("job_state")) not in finished]

    def cancel_all(self, timeout: float = 30.0) -> None:
        """End every job, and wait until Slurm shows none live (their processes gone)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = self.job_ids()
            if not live:
                return
            ids = [str(i) for i in live]
            self.run("scancel", "--full", "--signal=KILL", *ids)
            self.run("scancel", *ids)
            time.sleep(0.3)  # not a wait: one round of a cancel loop that re-reads the queue

    def stop(self) -> None:
        """Cancel every job, then stop slurmd, slurmctld and munged; kill what is left."""
        with contextlib.suppress(ServiceError, OSError, subprocess.SubprocessError, ValueError):
            if self.slurmctld is not None and self.slurmctld.running:
                self.cancel_all()
        for service in (self.slurmd, self.slurmctld, self.munged):
            if service is not None:
                service.stop(grace=10)
        kill_leftovers(self.conf)
        shutil.rmtree(self.runtime, ignore_errors=True)

    # ``iris dev``'s services share this shape (ManagedProcess): start, wait_ready, stop.
    def wait_ready(self, timeout: float = 60.0) -> None:
        if not self.node_up():
            raise ServiceError(f"Slurm's node did not come up; see {self.root / 'logs'}")


def kill_leftovers(conf: Path) -> int:
    """SIGKILL every process whose environment names ``conf`` as its SLURM_CONF (a job's, or a
    slurmstepd that outlived a killed slurmd); how many."""
    marker = f"SLURM_CONF={conf}".encode()
    killed = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if marker in environ.split(b"\0"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
    return killed


def point_at(
    config: FederationConfig, cluster: SlurmCluster, *, backends: Iterable[str] | None = None
) -> None:
    """Point the Slurm backends of ``config`` (in place; those of ``backends`` only, if given) at
    ``cluster``: its slurm.conf, and its work directory and the jobs' PATH where none is set."""
    wanted = None if backends is None else set(backends)
    for c in config.clusters:
        for b in c.backends:
            if b.kind == "slurm" and (wanted is None or b.id in wanted):
                b.slurm_conf = str(cluster.conf)
                b.slurm_work_dir = b.slurm_work_dir or str(cluster.work_dir)
                b.slurm_env.setdefault("PATH", cluster.job_path)


def for_dev(spec: SlurmSpec, config: FederationConfig, data_dir: Path) -> tuple[SlurmCluster, Path]:
    """``iris dev --backend slurm``: the config's one local Slurm, under ``DATA_DIR/slurm``, and the
    config its controllers read, ``DATA_DIR/clusters-slurm.json``: ``config`` with its Slurm
    backends pointed at that Slurm (``point_at``)."""
    cluster = SlurmCluster(spec, data_dir / "slurm")
    pointed = config.model_copy(deep=True)
    point_at(pointed, cluster)
    path = data_dir / "clusters-slurm.json"
    path.write_text(pointed.model_dump_json(indent=2))
    os.chmod(path, 0o600)
    return cluster, path


@contextlib.contextmanager
def running(spec: SlurmSpec, root: Path, timeout: float = 60.0) -> Iterator[SlurmCluster]:
    """A started cluster for the block, stopped after it."""
    cluster = SlurmCluster(spec, root)
    try:
        cluster.start(timeout)
        yield cluster
    finally:
        cluster.stop()
