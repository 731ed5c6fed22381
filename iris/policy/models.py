"""Plain models the scheduling policy reasons about (docs/DESIGN.md, "Vocabulary", "Classification",
"Placement").

Pure data: no I/O, no temporalio. The same models travel through Temporal payloads
(pydantic converter), the controller API and the CLI's JSON output.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from iris.policy.reasons import ReasonCode

ROUTING_KEYS: frozenset[str] = frozenset({"device-type", "device-variant", "preemptible", "region", "zone"})
# The availability block version this code understands; any other version is treated as "no block".
AVAILABILITY_VERSION = 1
DEVICE_TYPES: frozenset[str] = frozenset({"cpu", "gpu", "tpu"})
MAX_EPOCH_MS = 2**63 - 1


class Band(IntEnum):
    """Priority band: a lower number is a higher priority."""

    PRODUCTION = 1
    INTERACTIVE = 2
    BATCH = 3

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Band:
        try:
            return cls[text.strip().upper()]
        except KeyError:
            names = ", ".join(b.label for b in cls)
            raise ValueError(f"unknown priority band {text!r} (expected one of: {names})") from None


class Op(StrEnum):
    EQ = "EQ"
    NE = "NE"
    IN = "IN"
    NOT_IN = "NOT_IN"
    EXISTS = "EXISTS"
    NOT_EXISTS = "NOT_EXISTS"


class Constraint(BaseModel):
    """One routing constraint on a backend attribute, e.g. ``device-variant EQ h100``."""

    model_config = ConfigDict(frozen=True)

    key: str
    op: Op = Op.EQ
    values: tuple[str, ...] = ()

    def describe(self) -> str:
        vals = ",".join(self.values)
        if self.op is Op.EQ:
            return f"{self.key}={vals}"
        if self.op is Op.NE:
            return f"{self.key}!={vals}"
        if self.op is Op.IN:
            return f"{self.key} in [{vals}]"
        if self.op is Op.NOT_IN:
            return f"{self.key} not in [{vals}]"
        if self.op is Op.EXISTS:
            return f"{self.key} exists"
        return f"{self.key} absent"


class DeviceRequest(BaseModel):
    """What one job asks for: ``replicas`` x ``count`` devices of one type/variant, on one backend."""

    model_config = ConfigDict(frozen=True)

    type: str = "cpu"
    variant: str = "auto"
    count: int = Field(default=0, ge=0)
    replicas: int = Field(default=1, ge=1)

    @property
    def total(self) -> int:
        return self.count * self.replicas


class HeldByBand(BaseModel):
    band: Band
    amounts: dict[str, int] = Field(default_factory=dict)


class Availability(BaseModel):
    """A backend's versioned capacity block (docs/DESIGN.md, "Capacity reports"). Tokens are
    lowercased variants in chips."""

    version: int = AVAILABILITY_VERSION
    # Stored as a 64-bit integer (the reservation ledger): a report claiming more is malformed.
    observation_epoch_ms: int = Field(default=0, ge=0, le=MAX_EPOCH_MS)
    amounts: dict[str, int] = Field(default_factory=dict)
    total_amounts: dict[str, int] = Field(default_factory=dict)
    held_by_band: list[HeldByBand] = Field(default_factory=list)
    # The part of held_by_band that running work exempt from preemption holds (a job back from a
    # preemption, within its cluster's preempt_exempt_s): no band may reclaim it yet
    # (docs/DESIGN.md, "Capacity reports"). An older peer leaves it out: nothing exempt.
    exempt_by_band: list[HeldByBand] = Field(default_factory=list)


class BackendReport(BaseModel):
    """One execution pool inside a cluster, as its controller advertises it."""

    backend_id: str
    advertised_attributes: dict[str, list[str]] = Field(default_factory=dict)
    availability: Availability | None = None
    # How its jobs are isolated (docs/SECURITY.md, "The job sandbox"): "bwrap", or "none: <why>";
    # None from a backend that does not say (a Ray backend, an older controller).
    sandbox: str | None = Field(default=None, max_length=500)


class PeerReport(BaseModel):
    """The latest known state of one cluster (home included), as the manager last saw it."""

    peer_id: str
    reachable: bool = True
    last_contact_ms: int | None = None
    backends: list[BackendReport] = Field(default_factory=list)
    error: str | None = None


class RunningOn(BaseModel):
    """Where a job holding devices was placed, and when (docs/DESIGN.md, "Backfill")."""

    model_config = ConfigDict(frozen=True)

    peer_id: str
    backend_id: str
    since_ms: int


class JobShape(BaseModel):
    """Everything the policy needs to know about one job."""

    job_id: str
    constraints: tuple[Constraint, ...] = ()
    device: DeviceRequest = DeviceRequest()
    band: Band = Band.INTERACTIVE
    target_cluster: str | None = None
    submit_ms: int = 0
    deadline_ms: int | None = None
    # Who submitted it (the spec's user, which the workflow verifies against the signature); ""
    # in shapes stored before it was kept: the fair share then counts the job id's first segment.
    user: str = ""
    # The most one attempt runs (its --timeout), which backfill plans with; None: its band's
    # default (:class:`Backfill`), an estimate only, since nothing enforces it.
    time_limit_ms: int | None = Field(default=None, ge=1)
    # Where and since when it holds devices: set only in a tick's ``in_use``, from the ledger of
    # promotions; None for a job whose backend or start is not known (it never frees devices in
    # backfill's reckoning).
    running_on: RunningOn | None = None


class Disposition(StrEnum):
    LOCAL = "local"
    QUEUE = "queue"
    REJECT = "reject"


# --- Availability ledger and the placement tick (docs/DESIGN.md, "Placement", "Promotion (the CAS)") ---


class Reservation(BaseModel):
    """Capacity a confirmed promotion charged to one backend, valid for one observation only.

    ``band`` bounds what the reservation could have reclaimed when it is replayed; None means any.
    """

    model_config = ConfigDict(frozen=True)

    peer_id: str
    backend_id: str
    observation_epoch_ms: int
    amounts: dict[str, int] = Field(default_factory=dict)
    band: Band | None = None
    job_id: str = ""


class Placement(BaseModel):
    """The tick's decision to promote one job to one (peer, backend).

    ``reserved`` is what to charge the ledger once the promotion commits; empty for a shape-only
    or force-routed placement (backend_id ``""``), whose capacity the manager cannot see.
    """

    job_id: str
    peer_id: str
    backend_id: str
    band: Band = Band.INTERACTIVE
    observation_epoch_ms: int | None = None
    reserved: dict[str, int] = Field(default_factory=dict)
    verified: bool = True
    preempts: bool = False
    forced: bool = False
    reason: str = ""
    # Backfilled: placed on devices held for this waiting job, because its time limit ends before
    # that job's reserved start (docs/DESIGN.md, "Backfill").
    ahead_of: str | None = None

    def reservation(self) -> Reservation | None:
        """The ledger entry to record with the promotion, if the placement reserves anything."""
        if not self.reserved or self.observation_epoch_ms is None:
            return None
        return Reservation(
            peer_id=self.peer_id,
            backend_id=self.backend_id,
            observation_epoch_ms=self.observation_epoch_ms,
            amounts=dict(self.reserved),
            band=self.band,
            job_id=self.job_id,
        )


class Classification(BaseModel):
    """The submit-time decision (docs/DESIGN.md, "Classification"), with the reason a human reads.

    ``placement`` is set for a LOCAL decision: the home backend to promote the job to through the
    CAS, with what to reserve there (nothing when home's capacity for the job cannot be verified).
    """

    disposition: Disposition
    pinned_cluster: str | None = None
    reason: str
    placement: Placement | None = None
    # The reason's stable code when classification names one (a job too large for every backend
    # of its shape: ``TooLarge``); None leaves the state's own (iris/jobs.py state_code).
    code: ReasonCode | None = None


class WaitKind(StrEnum):
    """Why one peer cannot take a job this tick."""

    UNREACHABLE = "unreachable"
    STALE = "stale"
    UNKNOWN_PEER = "unknown_peer"
    NO_SHAPE = "no_shape"
    FULL = "full"
    PER_TICK_CAP = "per_tick_cap"


class PeerVerdict(BaseModel):
    """One reason, shared by every peer in ``peer_ids`` (grouped to keep payloads small)."""

    kind: WaitKind
    peer_ids: list[str]
    message: str
    token: str | None = None
    needed: int | None = None
    available: int | None = None


class JobExplanation(BaseModel):
    """Why a job is still queued after a tick: a summary and a reason for every candidate peer."""

    job_id: str
    summary: str
    # The summary's stable code (iris/policy/reasons.py).
    code: ReasonCode = ReasonCode.Pending
    verdicts: list[PeerVerdict] = Field(default_factory=list)
    # Devices held for it (``Reserved``): where, how many and from when.
    hold: Hold | None = None

    def for_peer(self, peer_id: str) -> PeerVerdict | None:
        return next((v for v in self.verdicts if peer_id in v.peer_ids), None)


class WaitingGroup(BaseModel):
    """Jobs left queued for the same reasons (same shape, band, need and pin)."""

    job_ids: list[str]
    summary: str
    # The summary's stable code (iris/policy/reasons.py).
    code: ReasonCode = ReasonCode.Pending
    verdicts: list[PeerVerdict] = Field(default_factory=list)


DEFAULT_AGING_HORIZON_MS = 86_400_000


class Quotas(BaseModel):
    """Per-user caps on devices in use; None (the default) caps nothing."""

    model_config = ConfigDict(frozen=True)

    max_devices_per_user: int | None = Field(default=None, ge=1)
    # A cap per band (what the user's jobs of that band hold), besides the overall one.
    per_band: dict[Band, Annotated[int, Field(ge=1)]] = Field(default_factory=dict)

    def cap(self, band: Band) -> int | None:
        return self.per_band.get(band)

    @property
    def any(self) -> bool:
        return self.max_devices_per_user is not None or bool(self.per_band)


class FairShare(BaseModel):
    """The fair-share settings of one tick (docs/DESIGN.md, "Fair share and aging"; from
    iris/config.py's ``aging_horizon_s`` and ``[quotas]``)."""

    model_config = ConfigDict(frozen=True)

    # The most a user's share can delay its jobs (a user holding every device: this much); 0 = FIFO.
    aging_horizon_ms: int = Field(default=DEFAULT_AGING_HORIZON_MS, ge=0)
    quotas: Quotas = Quotas()


DEFAULT_BAND_LIMITS_MS: dict[Band, int] = {
    Band.PRODUCTION: 24 * 3_600_000,
    Band.INTERACTIVE: 4 * 3_600_000,
    Band.BATCH: 24 * 3_600_000,
}


class Backfill(BaseModel):
    """Backfill's settings for one tick (docs/DESIGN.md, "Backfill"; iris/config.py ``[backfill]``)."""

    model_config = ConfigDict(frozen=True)

    # Off: no job is held for, every job that fits goes (the tick before backfill).
    enabled: bool = True
    # The time limit of a job without --timeout, per band.
    default_limit_ms: dict[Band, Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: dict(DEFAULT_BAND_LIMITS_MS)
    )

    def limit_ms(self, job: JobShape) -> int:
        if job.time_limit_ms is not None:
            return job.time_limit_ms
        return self.default_limit_ms.get(job.band, DEFAULT_BAND_LIMITS_MS[job.band])


class Hold(BaseModel):
    """Devices held for a waiting job (EASY backfill): from ``start_ms``, the earliest time enough of
    them are free on one backend as the jobs there reach their time limits, ``amount`` of ``token``
    are its. Until then a job may use them only if its time limit ends by ``start_ms``, or if it
    takes no more than ``spare`` (what is free then beyond ``amount``)."""

    job_id: str
    peer_id: str
    backend_id: str
    token: str
    amount: int
    start_ms: int
    spare: int


class PlanRequest(BaseModel):
    """Everything one tick decides on: the queue, the last reports and the ledger."""

    home: str
    jobs: list[JobShape] = Field(default_factory=list)
    reports: list[PeerReport] = Field(default_factory=list)
    reservations: list[Reservation] = Field(default_factory=list)
    now_ms: int
    stale_after_ms: int = Field(ge=0)
    max_per_peer: int | None = Field(default=None, ge=1)
    # Placements each paced cluster may take this tick, from its handoff rate (iris/policy/pacing.py);
    # a cluster not named is not paced.
    allowance: dict[str, int] = Field(default_factory=dict)
    # The jobs holding devices now (promoted or handed off, or offered a placement): what each
    # user's fair share and caps count.
    in_use: list[JobShape] = Field(default_factory=list)
    fair_share: FairShare = FairShare()
    backfill: Backfill = Backfill()


class PlanResult(BaseModel):
    """The tick's output: placements in queue order, expired job ids, why the rest wait, and the
    devices held for waiting jobs (backfill), in the order they were held."""

    placements: list[Placement] = Field(default_factory=list)
    expired: list[str] = Field(default_factory=list)
    waiting: list[WaitingGroup] = Field(default_factory=list)
    holds: list[Hold] = Field(default_factory=list)

    def hold_for(self, job_id: str) -> Hold | None:
        return next((h for h in self.holds if h.job_id == job_id), None)

    def explain(self, job_id: str) -> JobExplanation | None:
        for group in self.waiting:
            if job_id in group.job_ids:
                return JobExplanation(
                    job_id=job_id,
                    summary=group.summary,
                    code=group.code,
                    verdicts=group.verdicts,
                    hold=self.hold_for(job_id),
                )
        return None

    def placement_for(self, job_id: str) -> Placement | None:
        return next((p for p in self.placements if p.job_id == job_id), None)

    @property
    def capped(self) -> bool:
        """Some waiting job was held back by a peer's per-tick cap, so another tick may place more.

        The cap is reported ahead of fullness for a capped peer, so it may also place nothing."""
        return any(v.kind is WaitKind.PER_TICK_CAP for group in self.waiting for v in group.verdicts)
