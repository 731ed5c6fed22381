"""Plain models the scheduling policy reasons about (SPEC §2, §4, §5).

Pure data: no I/O, no temporalio. The same models travel through Temporal payloads
(pydantic converter), the controller API and the CLI's JSON output.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum

from pydantic import BaseModel, ConfigDict, Field

ROUTING_KEYS: frozenset[str] = frozenset({"device-type", "device-variant", "preemptible", "region", "zone"})
# The availability block version this code understands; any other version is treated as "no block".
AVAILABILITY_VERSION = 1
DEVICE_TYPES: frozenset[str] = frozenset({"cpu", "gpu", "tpu"})


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
    """What one job asks for: ``replicas`` × ``count`` devices of one type/variant, on one backend."""

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
    """A backend's versioned capacity block (SPEC §5). Tokens are lowercased variants in chips."""

    version: int = AVAILABILITY_VERSION
    observation_epoch_ms: int = 0
    amounts: dict[str, int] = Field(default_factory=dict)
    total_amounts: dict[str, int] = Field(default_factory=dict)
    held_by_band: list[HeldByBand] = Field(default_factory=list)


class BackendReport(BaseModel):
    """One execution pool inside a cluster, as its controller advertises it."""

    backend_id: str
    advertised_attributes: dict[str, list[str]] = Field(default_factory=dict)
    availability: Availability | None = None


class PeerReport(BaseModel):
    """The latest known state of one cluster (home included), as the manager last saw it."""

    peer_id: str
    reachable: bool = True
    last_contact_ms: int | None = None
    backends: list[BackendReport] = Field(default_factory=list)
    error: str | None = None


class JobShape(BaseModel):
    """Everything the policy needs to know about one job."""

    job_id: str
    constraints: tuple[Constraint, ...] = ()
    device: DeviceRequest = DeviceRequest()
    band: Band = Band.INTERACTIVE
    target_cluster: str | None = None
    submit_ms: int = 0
    deadline_ms: int | None = None


class Disposition(StrEnum):
    LOCAL = "local"
    QUEUE = "queue"
    REJECT = "reject"


class Classification(BaseModel):
    """The submit-time decision (SPEC §4), with the reason a human reads."""

    disposition: Disposition
    pinned_cluster: str | None = None
    reason: str
