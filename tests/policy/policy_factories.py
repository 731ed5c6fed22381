"""Small builders for policy tests: reports, backends and jobs in one line each."""

from __future__ import annotations

from iris.policy import (
    Availability,
    BackendReport,
    Band,
    Constraint,
    DeviceRequest,
    HeldByBand,
    JobShape,
    Op,
    PeerReport,
)

NOW = 1_000_000
STALE = 30_000
EPOCH = 990_000


def gpu_attrs(variant: str = "h100", **extra: str) -> dict[str, list[str]]:
    attrs = {"device-type": ["gpu"], "device-variant": [variant]}
    attrs.update({k: [v] for k, v in extra.items()})
    return attrs


def backend(
    backend_id: str,
    attrs: dict[str, list[str]] | None = None,
    *,
    free: dict[str, int] | None = None,
    held: dict[Band, dict[str, int]] | None = None,
    epoch: int = EPOCH,
    version: int = 1,
    legacy: bool = False,
) -> BackendReport:
    """A backend; ``legacy`` omits the availability block, ``free=None`` with no held means legacy."""
    if legacy or (free is None and held is None):
        return BackendReport(backend_id=backend_id, advertised_attributes=attrs or {})
    block = Availability(
        version=version,
        observation_epoch_ms=epoch,
        amounts=free or {},
        total_amounts={},
        held_by_band=[HeldByBand(band=b, amounts=a) for b, a in (held or {}).items()],
    )
    return BackendReport(backend_id=backend_id, advertised_attributes=attrs or {}, availability=block)


def h100(backend_id: str, free: int, *, held: dict[Band, int] | None = None, **kw: object) -> BackendReport:
    held_amounts = {b: {"h100": n} for b, n in (held or {}).items()}
    return backend(backend_id, gpu_attrs("h100"), free={"h100": free}, held=held_amounts, **kw)  # type: ignore[arg-type]


def cpu_backend(backend_id: str = "cpu") -> BackendReport:
    return backend(backend_id, {"device-type": ["cpu"], "region": ["us-central1"]})


def peer(
    peer_id: str,
    *backends: BackendReport,
    reachable: bool = True,
    last_contact_ms: int | None = NOW - 1_000,
) -> PeerReport:
    return PeerReport(
        peer_id=peer_id, reachable=reachable, last_contact_ms=last_contact_ms, backends=list(backends)
    )


def job(
    job_id: str = "alice/job",
    *,
    variant: str | None = "h100",
    count: int = 8,
    replicas: int = 1,
    device_type: str | None = None,
    band: Band = Band.INTERACTIVE,
    pin: str | None = None,
    submit_ms: int = 0,
    deadline_ms: int | None = None,
    constraints: tuple[Constraint, ...] = (),
) -> JobShape:
    if variant is None and device_type is None:
        device = DeviceRequest(replicas=replicas)
    elif device_type == "tpu":
        device = DeviceRequest(type="tpu", variant=variant or "auto", count=count, replicas=replicas)
    else:
        device = DeviceRequest(
            type=device_type or "gpu", variant=variant or "auto", count=count, replicas=replicas
        )
    return JobShape(
        job_id=job_id,
        constraints=constraints,
        device=device,
        band=band,
        target_cluster=pin,
        submit_ms=submit_ms,
        deadline_ms=deadline_ms,
    )


def cpu_job(job_id: str = "alice/cpu", **kw: object) -> JobShape:
    return job(job_id, variant=None, count=0, **kw)  # type: ignore[arg-type]


def eq(key: str, value: str) -> Constraint:
    return Constraint(key=key, op=Op.EQ, values=(value,))
