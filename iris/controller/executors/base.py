"""The contract between the controller and one execution backend (docs/DESIGN.md, "Components").

The controller (``core.Executor``) owns admission, the job table and persistence; a backend owns
how its jobs run and what capacity it reports. Backends change job records only through the
``JobHost`` they are given, so every transition is written to the store the same way whatever the
kind.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from iris.config import BackendConfig, ClusterConfig
from iris.controller.bundles import BundleStore
from iris.controller.errors import InvalidArgument
from iris.controller.models import ControllerJobState
from iris.controller.state import JobRecord, now_ms
from iris.policy.models import Availability, BackendReport, Band, DeviceRequest, HeldByBand
from iris.policy.preemption import RunningTask, is_exempt

CPU_RESOURCE = "cpu"
_AUTO_VARIANTS = frozenset({"", "auto"})


class BackendUnreachable(Exception):
    """The engine behind a backend does not answer: its capacity is unknown, never free."""


@dataclass(frozen=True)
class Demand:
    """What one job takes from its backend: ``replicas`` units of ``resource`` of ``per_replica`` each."""

    resource: str  # a device token, or CPU_RESOURCE
    per_replica: int
    replicas: int

    @property
    def is_cpu(self) -> bool:
        return self.resource == CPU_RESOURCE

    @property
    def total(self) -> int:
        return self.per_replica * self.replicas


def demand_for(backend: BackendConfig, device: DeviceRequest) -> Demand:
    """Resolve a device request against a backend, or raise InvalidArgument with the reason."""
    if device.count == 0 or device.type.lower() == "cpu":
        if device.replicas > backend.cpu_slots:
            raise InvalidArgument(
                f"backend {backend.id} runs at most {backend.cpu_slots} CPU processes; "
                f"{device.replicas} replicas requested"
            )
        return Demand(CPU_RESOURCE, 1, device.replicas)
    token = device.variant.strip().lower()
    if token in _AUTO_VARIANTS:
        tokens = [t for t, n in backend.devices.items() if n > 0]
        if len(tokens) != 1:
            raise InvalidArgument(
                f"backend {backend.id} cannot resolve device variant 'auto' "
                f"(device tokens: {sorted(tokens) or 'none'}); name the variant"
            )
        token = tokens[0]
    total = backend.devices.get(token, 0)
    if total <= 0:
        raise InvalidArgument(f"backend {backend.id} has no {token!r} devices")
    if device.total > total:
        raise InvalidArgument(
            f"backend {backend.id} has {total} {token} devices; "
            f"{device.replicas}x{device.count}={device.total} requested"
        )
    return Demand(token, device.count, device.replicas)


def log_path_for(state_dir: Path, job_id: str, attempt: int) -> Path:
    digest = hashlib.sha256(job_id.encode()).hexdigest()[:32]
    return state_dir / "logs" / f"{digest}-{attempt}.log"


class JobHost(Protocol):
    """What a backend may ask of the controller that owns the job table."""

    @property
    def cluster(self) -> ClusterConfig: ...

    @property
    def state_dir(self) -> Path: ...

    @property
    def bundles(self) -> BundleStore: ...

    def save(self, job: JobRecord) -> None:
        """Persist the job's current record."""

    def settle(
        self,
        job: JobRecord,
        state: ControllerJobState,
        *,
        exit_code: int | None = None,
        error: str | None = None,
    ) -> None:
        """Make the job terminal (persisted, waiters woken)."""

    def notify(self, job_id: str) -> None:
        """Wake whoever waits on the job's state."""


class Backend(ABC):
    """One execution pool of the cluster. Every method runs on the controller's event loop thread."""

    def __init__(self, config: BackendConfig, host: JobHost) -> None:
        self.config = config
        self.host = host
        # How long a job back from a preemption is no victim (docs/DESIGN.md, "Preemption").
        self.preempt_exempt_ms = round(host.cluster.preempt_exempt_s * 1000)

    def demand(self, device: DeviceRequest) -> Demand:
        """The job's demand here, or InvalidArgument when this backend can never run it."""
        return demand_for(self.config, device)

    def running_task(self, job: JobRecord, resource: str, amount: int) -> RunningTask:
        """``job`` as a candidate victim of ``choose_victims``, holding ``amount`` of ``resource``."""
        return RunningTask(
            task_id=job.job_id,
            band=job.band,
            amounts={resource: amount},
            started_ms=job.started_ms or 0,
            preempted_before=job.preemptions,
        )

    def exempt(self, job: JobRecord, at_ms: int) -> bool:
        """Whether the running ``job`` may not be preempted at ``at_ms``: back from a preemption (or
        a loss) less than ``preempt_exempt_s`` ago, and not already on its way out."""
        if job.started_ms is None or job.preempted is not None or job.terminate_requested:
            return False
        task = self.running_task(job, "", 0)
        return is_exempt(task, now_ms=at_ms, exempt_ms=self.preempt_exempt_ms)

    def capacity_report(
        self,
        observed_ms: int,
        free: dict[str, int],
        totals: dict[str, int],
        running: Iterable[JobRecord],
        *,
        at_ms: int | None = None,
    ) -> BackendReport:
        """The capacity report (docs/DESIGN.md, "Capacity reports"): free and total chips per token,
        what the ``running`` jobs hold, by band (CPU jobs hold no chips), and the part of it exempt
        from preemption at ``at_ms`` (default: now), which no band may reclaim yet."""
        at_ms = now_ms() if at_ms is None else at_ms
        held: dict[Band, dict[str, int]] = {}
        exempt: dict[Band, dict[str, int]] = {}
        for job in running:
            try:
                demand = self.demand(job.device)
            except InvalidArgument:  # recovered under a config that no longer has its device
                continue
            if demand.is_cpu:
                continue
            for table in (held, exempt) if self.exempt(job, at_ms) else (held,):
                by_token = table.setdefault(job.band, {})
                by_token[demand.resource] = by_token.get(demand.resource, 0) + demand.total
        return BackendReport(
            backend_id=self.config.id,
            advertised_attributes=self.config.attributes,
            availability=Availability(
                observation_epoch_ms=observed_ms,
                amounts=free,
                total_amounts=totals,
                held_by_band=[HeldByBand(band=b, amounts=a) for b, a in sorted(held.items())],
                exempt_by_band=[HeldByBand(band=b, amounts=a) for b, a in sorted(exempt.items())],
            ),
        )

    def log_path(self, job: JobRecord) -> Path:
        return log_path_for(self.host.state_dir, job.job_id, job.attempts)

    @abstractmethod
    def recover(self, jobs: list[JobRecord]) -> None:
        """At start: take over this backend's non-terminal jobs found in the store."""

    @abstractmethod
    def accept(self, job: JobRecord) -> None:
        """A new PENDING job (already persisted): run it when it can run. Must not await."""

    @abstractmethod
    def cancel_pending(self, job: JobRecord) -> bool:
        """Drop a PENDING job that never reached the engine; False if it may already be running."""

    @abstractmethod
    def stop(self, job: JobRecord) -> None:
        """Stop a started job (``terminate_requested`` is already set and saved)."""

    @abstractmethod
    def report(self) -> BackendReport:
        """The capacity report (docs/DESIGN.md, "Capacity reports"); raise BackendUnreachable when
        it cannot be known."""

    async def refresh_log(self, job: JobRecord) -> None:  # noqa: B027 - optional hook
        """Bring the job's log file up to date before it is read (engines that keep their own)."""

    @abstractmethod
    async def shutdown(self) -> None:
        """The controller stops."""
