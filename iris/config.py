"""Federation and cluster configuration, loaded from one TOML file.

The file names the home cluster and every cluster of the federation (home included): where its
controller listens, its backends, and its object store. ``iris dev``, the worker, the CLI and each
controller read the same file, so the demo stack and the tests agree on one topology.
"""

from __future__ import annotations

import json
import math
import os
import re
import tomllib
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from iris.defaults import DEFAULT_DATA_DIR as DEFAULT_DATA_DIR
from iris.defaults import PROJECT_ROOT as PROJECT_ROOT
from iris.policy.models import DEFAULT_BAND_LIMITS_MS, Backfill, Band, FairShare, Quotas
from iris.userkeys import parse_public_key

DEFAULT_CONFIG = PROJECT_ROOT / "config" / "clusters.toml"
CONFIG_ENV = "IRIS_CONFIG"


class ConfigError(Exception):
    """The configuration cannot be used; the message is one line for a human."""


# The largest uid a sandbox pool may use: below 2**31 - 1 (uid_t -1 means "unchanged" to the kernel).
MAX_SANDBOX_UID = 2**31 - 2


def uid_range(value: str) -> range:
    """``"FIRST-LAST"`` as the uids it names; ValueError unless 1 <= FIRST <= LAST <= 2**31 - 2."""
    first, sep, last = value.strip().partition("-")
    if not sep or not first.strip().isdigit() or not last.strip().isdigit():
        raise ValueError(f"{value!r} is not a uid range FIRST-LAST")
    lo, hi = int(first), int(last)
    if not 1 <= lo <= hi <= MAX_SANDBOX_UID:
        raise ValueError(f"{value!r}: need 1 <= FIRST <= LAST <= {MAX_SANDBOX_UID}")
    return range(lo, hi + 1)


# A Slurm partition name or GRES type, as the backend passes it on sbatch's command line.
_SLURM_NAME = re.compile(r"[A-Za-z0-9._-]+")
_BANDS = ("production", "interactive", "batch")


class BackendConfig(BaseModel):
    """One execution pool of a cluster: attributes it advertises and devices it has."""

    id: str
    attributes: dict[str, list[str]] = Field(default_factory=dict)
    # Device slots per token (lowercased variant), e.g. {"h100": 16}. Empty = CPU only, no gate.
    devices: dict[str, int] = Field(default_factory=dict)
    # How many jobs without devices may run at once (CPU jobs are not gated by the policy).
    cpu_slots: int = Field(default=8, ge=1)
    # Where the jobs run: local processes with device slots, a Ray cluster through its Jobs API, or
    # a Slurm cluster through its commands (docs/DESIGN.md, "The Slurm backend"). For "ray" and
    # "slurm", `devices` names the tokens served and the most one job may ask for; the capacity
    # report comes from the engine itself.
    kind: Literal["process", "ray", "slurm"] = "process"
    # Ray: the Jobs API (dashboard) URL, e.g. "http://127.0.0.1:8265".
    address: str = ""
    # Ray: the GCS "host:port" capacity is read from; empty = the address's host, port 6379.
    gcs_address: str = ""
    # Ray: the custom resource of each device token (default: the token itself). Clusters sharing
    # one Ray head keep their devices apart with distinct names, e.g. {"h100": "cw-rno2a/h100"}.
    ray_resources: dict[str, str] = Field(default_factory=dict)
    # Ray: CPUs and memory (MiB, 0 = none) each replica's entrypoint reserves besides its devices.
    ray_cpus: float = Field(default=0.1, ge=0)
    ray_memory_mb: int = Field(default=0, ge=0)
    # Slurm (docs/DESIGN.md, "The Slurm backend"): the cluster's slurm.conf, given to every Slurm
    # command as SLURM_CONF (empty: the controller's own SLURM_CONF, else Slurm's default).
    slurm_conf: str = ""
    # Slurm: the partition jobs go to, and per band ("production", "interactive", "batch") another
    # one where a band's jobs go elsewhere. The backend's capacity is its partitions' nodes.
    slurm_partition: str = ""
    slurm_partitions: dict[str, str] = Field(default_factory=dict)
    # Slurm: the GPU GRES type of each device token (default: the token itself; "" = any type).
    # Backends sharing one Slurm keep their devices apart with distinct types, e.g.
    # {"h100": "cw-rno2a-h100"}.
    slurm_gres: dict[str, str] = Field(default_factory=dict)
    # Slurm: who the jobs run as (a user name or uid that exists on every node; empty: the
    # cluster's run_as). Only a root controller can submit as another user.
    slurm_user: str = ""
    # Slurm: where each job's working directory and output file go: a directory every node sees at
    # this same path (a shared filesystem on a real cluster). Empty: <state dir>/slurm-work, which
    # only a single-node Slurm on the controller's own host can see.
    slurm_work_dir: str = ""
    # Slurm: CPUs, and memory per CPU (MiB, 0 = the cluster's default), each replica asks for.
    slurm_cpus: int = Field(default=1, ge=1, le=4096)
    slurm_mem_per_cpu_mb: int = Field(default=0, ge=0)
    # Slurm: the environment every job starts from, before its own (PATH: where the nodes keep the
    # jobs' tools, e.g. {"PATH": "/opt/conda/bin:/usr/bin:/bin"}; default PATH /usr/local/bin:/usr/bin:/bin).
    slurm_env: dict[str, str] = Field(default_factory=dict)
    # Slurm: more sbatch options of the site's (e.g. ["--account=ml", "--qos=normal"]), before the
    # backend's own, which win.
    slurm_sbatch_args: list[str] = Field(default_factory=list)
    # Slurm: how often the backend reads the queue (one `squeue --json` and one `sinfo --json`).
    slurm_poll_s: float = Field(default=1.0, ge=0.1, le=60)

    @field_validator("attributes")
    @classmethod
    def _lower_attributes(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        return {k.lower(): [v.lower() for v in vs] for k, vs in value.items()}

    @field_validator("devices")
    @classmethod
    def _devices_positive(cls, value: dict[str, int]) -> dict[str, int]:
        for token, n in value.items():
            if n < 0:
                raise ValueError(f"device count for {token!r} must be >= 0")
        return {k.lower(): n for k, n in value.items()}

    @field_validator("ray_resources")
    @classmethod
    def _lower_tokens(cls, value: dict[str, str]) -> dict[str, str]:
        for token, name in value.items():
            if not name.strip():
                raise ValueError(f"Ray resource name for {token!r} must not be empty")
        return {k.lower(): v for k, v in value.items()}

    @model_validator(mode="after")
    def _ray_settings(self) -> BackendConfig:
        if self.kind == "ray":
            if not self.address.startswith(("http://", "https://")):
                raise ValueError(f'backend {self.id}: a Ray backend needs address = "http://HOST:PORT"')
            unknown = sorted(set(self.ray_resources) - set(self.devices))
            if unknown:
                raise ValueError(f"backend {self.id}: ray_resources names tokens not in devices: {unknown}")
        return self

    @field_validator("slurm_gres")
    @classmethod
    def _gres_types(cls, value: dict[str, str]) -> dict[str, str]:
        for token, gres in value.items():
            if not _SLURM_NAME.fullmatch(gres) and gres != "":
                raise ValueError(f"GRES type {gres!r} of {token!r}: letters, digits and ._- only")
        return {k.lower(): v for k, v in value.items()}

    @model_validator(mode="after")
    def _slurm_settings(self) -> BackendConfig:
        if self.kind != "slurm":
            return self
        where = f"backend {self.id}"
        if not _SLURM_NAME.fullmatch(self.slurm_partition):
            raise ValueError(f'{where}: a Slurm backend needs slurm_partition = "NAME" (of [A-Za-z0-9._-])')
        for band, partition in self.slurm_partitions.items():
            if band not in _BANDS:
                bands = ", ".join(_BANDS)
                raise ValueError(f"{where}: slurm_partitions: unknown band {band!r} (one of {bands})")
            if not _SLURM_NAME.fullmatch(partition):
                raise ValueError(f"{where}: slurm_partitions.{band}: {partition!r} is not a partition name")
        unknown = sorted(set(self.slurm_gres) - set(self.devices))
        if unknown:
            raise ValueError(f"{where}: slurm_gres names tokens not in devices: {unknown}")
        for name, path in (("slurm_conf", self.slurm_conf), ("slurm_work_dir", self.slurm_work_dir)):
            if path and not os.path.isabs(path):
                raise ValueError(f"{where}: {name} {path!r} is not an absolute path")
        for key, val in self.slurm_env.items():
            if not key or "=" in key or "\x00" in key or "\x00" in val:
                raise ValueError(f"{where}: slurm_env: invalid variable {key!r}")
        for arg in self.slurm_sbatch_args:
            if not arg.startswith("-") or "\x00" in arg:
                raise ValueError(f"{where}: slurm_sbatch_args: {arg!r} is not an sbatch option")
        return self

    def slurm_partition_for(self, band: str) -> str:
        """The partition a job of ``band`` (its label) goes to."""
        return self.slurm_partitions.get(band, self.slurm_partition)

    def slurm_gres_type(self, token: str) -> str:
        return self.slurm_gres.get(token, token)

    @property
    def ray_gcs_address(self) -> str:
        """Where a Ray backend reads capacity: ``gcs_address``, else the dashboard's host on 6379."""
        if self.gcs_address:
            return self.gcs_address
        host = urlsplit(self.address).hostname or "127.0.0.1"
        return f"{host}:6379"

    def ray_resource(self, token: str) -> str:
        return self.ray_resources.get(token, token)


class ObjectStoreConfig(BaseModel):
    """Where a cluster reads artifacts, with its own credentials (never shared across clusters)."""

    kind: Literal["gcs", "s3"]
    bucket: str
    # Endpoint of the emulator or service; empty = the SDK default.
    endpoint: str = ""
    # Names of environment variables holding credentials (values never appear in config or payloads).
    access_key_env: str = ""
    secret_key_env: str = ""


class AuthConfig(BaseModel):
    """A cluster's identity and who it admits (docs/DESIGN.md, "Identity tokens", "Admission order").

    Key material is named, never inlined (except public keys, which are not secret): a file path or
    an environment variable holding the PEM. Relative paths resolve against the key directory given
    to the process (``--key-dir``, else ``$IRIS_KEY_DIR``).
    """

    model_config = ConfigDict(extra="forbid")

    # This cluster's Ed25519 signing key (PKCS#8 PEM); only this cluster's own processes read it.
    private_key_file: str = ""
    private_key_env: str = ""
    # This cluster's public key, pinned by every cluster that trusts it as a requester.
    public_key_file: str = ""
    public_key_env: str = ""
    public_key: str = ""
    # Clusters whose signed handoffs this cluster's controller admits.
    trusted_requesters: list[str] = Field(default_factory=list)
    # Clusters that may see and terminate every job here (operators' tooling), besides the owner.
    admins: list[str] = Field(default_factory=list)
    # Who may submit: "*" anyone, "*@domain" a domain (case-insensitive), or an exact identity.
    # Empty = nobody.
    allowed_submitters: list[str] = Field(default_factory=list)
    # Lifetime of the tokens this cluster mints; verifiers refuse anything longer than 5 minutes.
    token_ttl_s: int = Field(default=120, ge=5, le=300)

    @model_validator(mode="after")
    def _one_source_each(self) -> AuthConfig:
        if self.private_key_file and self.private_key_env:
            raise ValueError("set at most one of private_key_file and private_key_env")
        if sum(bool(x) for x in (self.public_key_file, self.public_key_env, self.public_key)) > 1:
            raise ValueError("set at most one of public_key_file, public_key_env and public_key")
        for pattern in self.allowed_submitters:
            domain = pattern[2:] if pattern.startswith("*@") else None
            if (
                not pattern.strip()
                or ("*" in pattern and pattern != "*" and domain is None)
                or (domain is not None and (not domain or "*" in domain or "@" in domain))
                or pattern.count("@") > 1
            ):
                raise ValueError(f"allowed_submitters entry {pattern!r}: use '*', '*@domain' or an identity")
        return self

    @property
    def has_public_key(self) -> bool:
        return bool(self.public_key_file or self.public_key_env or self.public_key)


class ClusterConfig(BaseModel):
    name: str
    host: str = "127.0.0.1"
    port: int = Field(ge=1, le=65535)
    backends: list[BackendConfig]
    object_store: ObjectStoreConfig | None = None
    # None: the controller admits unsigned requests (local experiments only: it refuses to start on
    # a non-loopback address without it, and warns on loopback).
    auth: AuthConfig | None = None
    # Serve /openapi.json, /docs and /redoc (behind the same authentication as the API); off by default.
    api_docs: bool = False
    # The user (name or uid) a root controller runs this cluster's process-backend jobs as, with
    # that user's primary group and no other (docs/DESIGN.md, "Job → controller"). A controller
    # that is not root cannot switch users and warns at start-up; "root" keeps root, with a warning.
    run_as: str = Field(default="nobody", min_length=1)
    # The job sandbox of this cluster's process backends (docs/SECURITY.md, "The job sandbox"):
    # "auto" runs each job in its own bubblewrap sandbox where the host allows it and otherwise
    # says at start-up (and in `iris peers`) what is lost; "required" refuses to start without
    # it; "off" runs jobs unsandboxed, as run_as. With the sandbox on, run_as is not used.
    sandbox: Literal["auto", "required", "off"] = "auto"
    # The uids a root controller's sandboxed jobs run as, "FIRST-LAST": one per running job, never
    # an existing account's. The default lies outside the ranges systemd allocates (homed users,
    # DynamicUser=), so no service's files belong to a job's uid.
    sandbox_uids: str = "60600-61183"
    # Sandboxed jobs share the host's network: they reach the control plane's loopback services
    # (Temporal, emulators, controllers, metrics). Off by default; on loses that isolation.
    sandbox_host_network: bool = False
    # Host paths a sandboxed job also sees, read-only, at the same path (an interpreter or a
    # dataset the jobs need). Never a directory that holds keys or state.
    sandbox_ro_paths: list[str] = Field(default_factory=list)
    # Operator-shared writable directories (checkpoints, datasets, scratch on a shared filesystem)
    # every sandboxed job sees read-write at the same path: what one job writes there, every other
    # job of the cluster can read and change (docs/SECURITY.md, "The job sandbox"). Each must
    # exist, and the controller refuses at start one that overlaps its state or key directory, or
    # holds or lies in a system path.
    sandbox_rw_paths: list[str] = Field(default_factory=list)
    # How long the controller keeps a finished job (its record, log and work directory) before
    # retention removes it (docs/DESIGN.md, "Retention").
    retention_s: float = Field(default=7 * 86_400.0, gt=0)
    # How long a job preempted for a higher band has between SIGTERM and SIGKILL (docs/DESIGN.md,
    # "Preemption").
    preempt_grace_s: float = Field(default=30.0, ge=0, le=3600)
    # How long a job back from a preemption (or a loss) is exempt from another one by interactive
    # work, from its attempt's start, like Slurm's PreemptExemptTime; production work overrides
    # it (docs/DESIGN.md, "Preemption"); 0: never.
    preempt_exempt_s: float = Field(default=300.0, ge=0, le=86_400)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @field_validator("sandbox_uids")
    @classmethod
    def _uid_range(cls, value: str) -> str:
        uid_range(value)
        return value.strip()

    @field_validator("sandbox_ro_paths", "sandbox_rw_paths")
    @classmethod
    def _absolute_paths(cls, value: list[str]) -> list[str]:
        for path in value:
            if not os.path.isabs(path):
                raise ValueError(f"{path!r} is not an absolute path")
        return value

    @property
    def sandbox_uid_range(self) -> range:
        return uid_range(self.sandbox_uids)

    @model_validator(mode="after")
    def _unique_backends(self) -> ClusterConfig:
        ids = [b.id for b in self.backends]
        if len(ids) != len(set(ids)):
            raise ValueError(f"cluster {self.name}: duplicate backend ids")
        return self


class UserConfig(BaseModel):
    """A principal who may submit, cancel and replay jobs (docs/DESIGN.md, "User → home").

    ``public_keys`` are the user's Ed25519 keys as ``iris keys user`` prints them
    (``ed25519:<base64>``); not secret. ``roles``: ``user`` (own jobs) and/or ``admin`` (anyone's
    jobs, and the ``production`` band).
    """

    model_config = ConfigDict(extra="forbid")

    public_keys: list[str] = Field(min_length=1)
    roles: list[Literal["admin", "user"]] = ["user"]

    @field_validator("public_keys")
    @classmethod
    def _ed25519_keys(cls, value: list[str]) -> list[str]:
        for key in value:
            parse_public_key(key)
        return value


class TemporalTLSConfig(BaseModel):
    """TLS to Temporal's frontend (docs/DESIGN.md, "Where secrets live"): PEM file paths. With
    ``server_ca`` the client verifies the server against that CA; with ``client_cert`` and
    ``client_key`` it presents its own certificate (mutual TLS). ``server_name`` is the name the
    server certificate must carry when it differs from the address's host."""

    model_config = ConfigDict(extra="forbid")

    server_ca: str = ""
    client_cert: str = ""
    client_key: str = ""
    server_name: str = ""

    @model_validator(mode="after")
    def _pair(self) -> TemporalTLSConfig:
        if bool(self.client_cert) != bool(self.client_key):
            raise ValueError("client_cert and client_key go together")
        return self


class TemporalConfig(BaseModel):
    address: str = "127.0.0.1:7233"
    namespace: str = "default"
    task_queue: str = "iris-federation"
    ui_port: int = 8233
    # None: plaintext (iris dev: the dev server listens on loopback only). docker-compose.yml sets it.
    tls: TemporalTLSConfig | None = None


class TelemetryConfig(BaseModel):
    """Tracing (docs/DESIGN.md, "Tracing"): off unless an OTLP endpoint is set, here or in the
    standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (which win)."""

    model_config = ConfigDict(extra="forbid")

    # An OTLP/HTTP collector's base URL, e.g. "http://127.0.0.1:4318": spans go to <url>/v1/traces.
    # Empty: no tracing (no exporter, no network). Credentials never go in the URL: the collector's
    # headers, if it needs any, come from OTEL_EXPORTER_OTLP_HEADERS.
    otlp_endpoint: str = ""

    @field_validator("otlp_endpoint")
    @classmethod
    def _http_url(cls, value: str) -> str:
        value = value.strip()
        if not value:
            return value
        # The value is never echoed: a mistaken one may hold a credential.
        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
        except ValueError:
            raise ValueError("not an http(s)://HOST[:PORT] URL") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("not an http(s)://HOST[:PORT] URL")
        if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
            raise ValueError(
                "takes no credentials, query or fragment (a collector's headers: OTEL_EXPORTER_OTLP_HEADERS)"
            )
        return value


class QuotasConfig(BaseModel):
    """Per-user caps on devices in use (docs/DESIGN.md, "Fair share and aging"): a job that would
    take its user past one waits with the reason code ``UserQuota``. Devices are accelerator chips
    (``count × replicas`` of a GPU or TPU job, whatever the variant); CPU jobs are not capped."""

    model_config = ConfigDict(extra="forbid")

    # The most devices one user's jobs may hold at once, all bands together; unset: no cap.
    max_devices_per_user: int | None = Field(default=None, ge=1)
    # The most devices one user's jobs of a band may hold at once, e.g. {batch = 16}; none by default.
    per_band: dict[str, int] = Field(default_factory=dict)

    @field_validator("per_band")
    @classmethod
    def _bands(cls, value: dict[str, int]) -> dict[str, int]:
        for band, cap in value.items():
            if band not in _BANDS:
                raise ValueError(f"unknown band {band!r} (one of {', '.join(_BANDS)})")
            if cap < 1:
                raise ValueError(f"the cap of band {band} must be at least 1")
        return value

    def policy(self) -> Quotas:
        return Quotas(
            max_devices_per_user=self.max_devices_per_user,
            per_band={Band.parse(band): cap for band, cap in self.per_band.items()},
        )


class BackfillConfig(BaseModel):
    """Backfill (docs/DESIGN.md, "Backfill"): devices are held for a job that cannot start where it
    can start soonest, and a later job may use them meanwhile only if its time limit ends first.
    A job's time limit is its ``--timeout``; these are the limits assumed for jobs without one,
    per band (an estimate: only ``--timeout`` is enforced)."""

    model_config = ConfigDict(extra="forbid")

    # Off: nothing is held; every job that fits goes (the tick before backfill).
    enabled: bool = True
    # The time limit of a job without --timeout, per band, in seconds.
    default_limit_s: dict[str, float] = Field(
        default_factory=lambda: {b.label: ms / 1000 for b, ms in DEFAULT_BAND_LIMITS_MS.items()}
    )

    @field_validator("default_limit_s")
    @classmethod
    def _limits(cls, value: dict[str, float]) -> dict[str, float]:
        for band, limit in value.items():
            if band not in _BANDS:
                raise ValueError(f"unknown band {band!r} (one of {', '.join(_BANDS)})")
            if not (math.isfinite(limit) and limit >= 1):
                raise ValueError(f"the default time limit of band {band} must be at least 1 s, got {limit}")
        return value

    def policy(self) -> Backfill:
        limits = dict(DEFAULT_BAND_LIMITS_MS)
        limits.update({Band.parse(band): math.ceil(s * 1000) for band, s in self.default_limit_s.items()})
        return Backfill(enabled=self.enabled, default_limit_ms=limits)


class WorkerConfig(BaseModel):
    """``[worker]``: what one ``iris worker`` process holds (docs/DESIGN.md, "Worker memory")."""

    # Job workflows kept in memory between their tasks (the sticky cache). A running job's
    # workflow sits idle until its cluster's watcher signals it; one evicted from the cache is
    # replayed from its history when that signal comes (a running job's history is short,
    # continue-as-new bounds it). The worker's memory grows with this, not with the jobs running.
    max_cached_workflows: int = Field(default=4096, ge=1, le=1_000_000)
    # Unset: the SDK's fixed 5 polls for workflow tasks, one of them for the non-sticky queue (every
    # new job's first task, every wake of a workflow the cache evicted). Set: Temporal's autoscaling
    # polls, at most this many open, for a worker holding more running jobs than its cache, whose
    # wakes then all come through the non-sticky queue (docs/DESIGN.md, "Worker memory").
    max_workflow_task_polls: int | None = Field(default=None, ge=2, le=1_000)


class FederationConfig(BaseModel):
    home: str
    temporal: TemporalConfig = TemporalConfig()
    # The worker process's own limits (`[worker]`).
    worker: WorkerConfig = WorkerConfig()
    # Tracing (docs/DESIGN.md, "Tracing"); off by default.
    telemetry: TelemetryConfig = TelemetryConfig()
    # A peer report older than this is treated as unknown (docs/DESIGN.md, "Staleness and reachability").
    # A cluster running an attempt that has not answered for this long has lost it: the attempt
    # ends and the job goes back to the queue (docs/DESIGN.md, "Attempts").
    peer_lost_after_s: float = Field(default=600.0, gt=0)
    stale_after_ms: int = Field(default=30_000, ge=1)
    clusters: list[ClusterConfig]
    s3_port: int = 9200
    gcs_port: int = 9201
    # The federation store (queue handles, reservation ledger, reports). Empty = SQLite file in the
    # data directory; IRIS_STORE_URL overrides (e.g. postgresql+psycopg://user@host/db).
    store_url: str = ""
    # The placement tick (docs/DESIGN.md, "The tick"): its period. Each cluster is protected by a
    # rate of handoffs a second (a token bucket holding one second's worth; docs/DESIGN.md,
    # "Handoff pacing"), and optionally by a cap per tick as well; None: no such limit.
    tick_interval_s: float = Field(default=1.0, gt=0, le=60)
    handoffs_per_s: float | None = Field(default=50.0, gt=0, le=10_000)
    max_per_peer_per_tick: int | None = Field(default=None, ge=1)
    # Fair share and aging within a band (docs/DESIGN.md, "Fair share and aging"): a user's jobs go
    # as if submitted later by this × their dominant share of the devices in use (0 to 1), so a job
    # goes ahead of every job of its band submitted more than this after it. 0: FIFO in a band.
    # A day by default: the waits it must outweigh are hours (the DESIGN section says why).
    aging_horizon_s: float = Field(default=86_400.0, ge=0, le=7 * 86_400)
    # Per-user caps on devices in use (`[quotas]`); none by default.
    quotas: QuotasConfig = QuotasConfig()
    # Backfill (`[backfill]`): on by default, with a day for production and batch jobs without
    # --timeout and four hours for interactive ones.
    backfill: BackfillConfig = BackfillConfig()
    # Mirroring (docs/DESIGN.md, "The change feed"): one watcher per cluster long-polls its change
    # feed and signals each changed job (and, every 30 minutes, each job whose record it has not
    # told); a running job also asks its cluster itself this often (the safety poll, which also
    # refreshes its relayed log). An hour: each poll wakes the job, and 10,000 jobs polling every
    # 15 minutes were more than one worker could serve (docs/BENCHMARKS.md, "Worker memory").
    # 0: no watchers, every running job polls its cluster (the design before the change feed).
    mirror_safety_poll_s: float = Field(default=3600.0, ge=0)
    # The handoff's retries (docs/DESIGN.md, "Errors, retries and parking"): the launch and the
    # bundle staging are tried 6 times, the first retry after handoff_retry_initial_s, each wait
    # doubling up to handoff_retry_max_s (1 s and 10 s: about 25 s before the park). A parked job
    # whose launch went unanswered asks its cluster again after parked_probe_first_s, doubling up
    # to parked_probe_max_s (15 s and 10 min). A job takes the values of the view it was
    # classified with.
    handoff_retry_initial_s: float = Field(default=1.0, gt=0, le=60)
    handoff_retry_max_s: float = Field(default=10.0, gt=0, le=600)
    parked_probe_first_s: float = Field(default=15.0, gt=0, le=3600)
    parked_probe_max_s: float = Field(default=600.0, gt=0, le=3600)
    # Who may submit, cancel and replay, with their public keys and roles (docs/DESIGN.md, "User →
    # home"); the worker verifies every request against it. ``iris dev`` adds the OS user (admin).
    users: dict[str, UserConfig] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _home_known(self) -> FederationConfig:
        names = [c.name for c in self.clusters]
        if len(names) != len(set(names)):
            raise ValueError("duplicate cluster names")
        if self.home not in names:
            raise ValueError(f"home cluster {self.home!r} is not among the clusters {names}")
        if self.handoff_retry_max_s < self.handoff_retry_initial_s:
            raise ValueError("handoff_retry_max_s must be at least handoff_retry_initial_s")
        if self.parked_probe_max_s < self.parked_probe_first_s:
            raise ValueError("parked_probe_max_s must be at least parked_probe_first_s")
        return self

    def fair_share(self) -> FairShare:
        """The tick's fair-share settings (iris/policy/fairshare.py)."""
        return FairShare(aging_horizon_ms=round(self.aging_horizon_s * 1000), quotas=self.quotas.policy())

    def backfill_policy(self) -> Backfill:
        """The tick's backfill settings (iris/policy/backfill.py)."""
        return self.backfill.policy()

    def cluster(self, name: str) -> ClusterConfig:
        for c in self.clusters:
            if c.name == name:
                return c
        raise KeyError(name)

    @property
    def home_cluster(self) -> ClusterConfig:
        return self.cluster(self.home)

    def check_cluster(self, name: str) -> None:
        """The seed's ``iris --cluster=NAME``: the cluster whose controller and federation a command
        talks to. Only the home cluster runs this federation's manager; ConfigError for a peer (with
        the name to use) or an unknown cluster."""
        if name == self.home:
            return
        if name in self.cluster_names:
            raise ConfigError(
                f"cluster {name!r} is a peer in this federation; jobs, peers and placement are managed "
                f"by its home cluster: use --cluster={self.home}"
            )
        raise ConfigError(
            f"unknown cluster {name!r} (clusters in this config: {', '.join(self.cluster_names)})"
        )

    @property
    def cluster_names(self) -> list[str]:
        return [c.name for c in self.clusters]


STORE_URL_ENV = "IRIS_STORE_URL"


def store_url(config: FederationConfig, data_dir: Path) -> str:
    """Where the federation store lives: env, then config, then a SQLite file under ``data_dir``."""
    return os.environ.get(STORE_URL_ENV) or config.store_url or f"sqlite:///{data_dir / 'federation.db'}"


def config_path(explicit: str | Path | None = None) -> Path:
    if explicit:
        return Path(explicit)
    env = os.environ.get(CONFIG_ENV)
    return Path(env) if env else DEFAULT_CONFIG


def load_config(path: str | Path | None = None) -> FederationConfig:
    """Load and validate the federation config; raise ConfigError with a one-line message."""
    p = config_path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {p}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {p} cannot be read: {exc}") from None
    try:
        # JSON is accepted too, for generated configs (tests write one with free ports).
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(
            f"config file {p} is not valid {p.suffix.lstrip('.').upper() or 'TOML'}: {exc}"
        ) from None
    try:
        return FederationConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise ConfigError(f"config file {p}: {where}: {first['msg']}") from None
