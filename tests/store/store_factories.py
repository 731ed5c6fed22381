"""One-line builders for the store tests: shapes, handles, reports and placements; ``Stores``, which
opens stores on one database (a module of its own name, not ``conftest``: another directory's
conftest may hold that name when several test directories are collected together)."""

from __future__ import annotations

from dataclasses import dataclass, field

from iris.policy.models import (
    Availability,
    BackendReport,
    Band,
    DeviceRequest,
    HeldByBand,
    JobShape,
    PeerReport,
    Placement,
)
from iris.store import FederationStore, JobHandle

NOW = 1_000_000
EPOCH = 990_000
PEER = "cw-us-east-02a"
BACKEND = "h100-a"


def shape(
    job_id: str,
    *,
    gpus: int = 8,
    variant: str = "h100",
    band: Band = Band.INTERACTIVE,
    submit_ms: int = 0,
    deadline_ms: int | None = None,
    target: str | None = None,
) -> JobShape:
    device = DeviceRequest(type="gpu", variant=variant, count=gpus) if gpus else DeviceRequest()
    return JobShape(
        job_id=job_id,
        device=device,
        band=band,
        submit_ms=submit_ms,
        deadline_ms=deadline_ms,
        target_cluster=target,
    )


def handle(job_id: str, incarnation: str = "inc-1", **kw: object) -> JobHandle:
    return JobHandle(job_id=job_id, incarnation=incarnation, shape=shape(job_id, **kw))  # type: ignore[arg-type]


def gpu_backend(
    backend_id: str = BACKEND,
    free: int = 8,
    *,
    epoch: int = EPOCH,
    held: dict[Band, int] | None = None,
    token: str = "h100",
    version: int = 1,
) -> BackendReport:
    block = Availability(
        version=version,
        observation_epoch_ms=epoch,
        amounts={token: free},
        total_amounts={token: free + sum((held or {}).values())},
        held_by_band=[HeldByBand(band=b, amounts={token: n}) for b, n in (held or {}).items()],
    )
    return BackendReport(
        backend_id=backend_id,
        advertised_attributes={"device-type": ["gpu"], "device-variant": [token]},
        availability=block,
    )


def report(
    peer_id: str = PEER, *backends: BackendReport, reachable: bool = True, last_contact_ms: int | None = NOW
) -> PeerReport:
    if not reachable:
        return PeerReport(peer_id=peer_id, reachable=False, error="connect: refused")
    return PeerReport(peer_id=peer_id, last_contact_ms=last_contact_ms, backends=list(backends))


def placement(
    job_id: str,
    *,
    peer: str = PEER,
    backend: str = BACKEND,
    need: int = 8,
    epoch: int | None = EPOCH,
    band: Band = Band.INTERACTIVE,
) -> Placement:
    return Placement(
        job_id=job_id,
        peer_id=peer,
        backend_id=backend,
        band=band,
        observation_epoch_ms=epoch,
        reserved={"h100": need} if need else {},
        verified=bool(need),
    )


@dataclass
class Stores:
    """Opens any number of stores (think: workers) on one database."""

    backend: str
    url: str
    schema: str | None = None
    opened: list[FederationStore] = field(default_factory=list)

    def open(self) -> FederationStore:
        store = FederationStore(self.url, schema=self.schema)
        self.opened.append(store)
        return store

    def close_all(self) -> None:
        while self.opened:
            self.opened.pop().close()
