"""Whether a job can ever fit (docs/DESIGN.md, "Classification", "Never fits"): pure.

A job runs on one backend, all its replicas together: its gate (``gate``: ``count × replicas``
chips of a concrete GPU variant, or one ``cpu`` slot per replica) must fit one backend's
``total_amounts`` for that token, whatever is free now. A job larger than every backend that
matches its routing constraints can never run; classification rejects it at submit instead of
queueing it for ever.

Only what is known counts against a job. A backend's total is known when its cluster's report is
OK (reachable, not stale) and its capacity block (a version this code reads) names the token in
``total_amounts``. A backend of a cluster that has never reported, is unreachable or stale, a
shape-only backend (no block), or a block that does not name the token, is "unknown": it might
hold the job, so the job is never rejected while one of its matching backends is unknown.
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import BaseModel

from iris.policy.availability import gate, usable_block
from iris.policy.models import BackendReport, JobShape
from iris.policy.routing import job_constraints, matches


class Candidate(BaseModel):
    """One backend a job could go to, and whether its report is one to trust for its total (its
    cluster is OK now)."""

    peer_id: str
    backend: BackendReport
    trusted: bool


class TooLarge(BaseModel):
    """A job larger than every backend of its shape: it needs ``need`` of ``token`` on one
    backend, and the largest matching one (``peer_id``/``backend_id``) has ``largest`` in all."""

    token: str
    need: int
    count: int
    replicas: int
    peer_id: str
    backend_id: str
    largest: int

    def reason(self) -> str:
        """``needs 32 h100 on one backend; the largest matching is cw-a/h100-a with 16``."""
        gang = f" ({self.replicas} replicas × {self.count})" if self.replicas > 1 and self.count > 0 else ""
        return (
            f"no backend can ever hold it: needs {self.need} {self.token} on one backend{gang}; "
            f"the largest matching is {self.peer_id}/{self.backend_id} with {self.largest}"
        )


def known_total(backend: BackendReport, token: str) -> int | None:
    """What ``backend`` has of ``token`` in all, from its block; None when the block does not say
    (no block, a version this code does not read, or no total for the token). Tokens compare
    lowercased and merged, negatives as 0, as ``Capacity.from_block`` reads them."""
    block = usable_block(backend)
    if block is None:
        return None
    totals = [max(0, amount) for key, amount in block.total_amounts.items() if key.strip().lower() == token]
    return sum(totals) if totals else None


def too_large(job: JobShape, candidates: Iterable[Candidate]) -> TooLarge | None:
    """Why ``job`` can never run on any of ``candidates``, or None if it might.

    None when the job is not gated (no token to measure), when no candidate matches its routing
    constraints (that is a shape mismatch, judged elsewhere), when any matching candidate's total
    is unknown (see the module), or when one matching total holds the job's whole gate.
    Otherwise the largest matching backend (ties: peer id, then backend id) is named.
    """
    need = gate(job.device)
    if need is None:
        return None
    token, amount = need
    constraints = job_constraints(job)
    largest: tuple[int, str, str] | None = None
    for c in candidates:
        if not matches(constraints, c.backend.advertised_attributes):
            continue
        total = known_total(c.backend, token) if c.trusted else None
        if total is None:
            return None  # it might hold the job: never grounds for a rejection
        if total >= amount:
            return None
        # Largest first; among equals the first peer, then the first backend, by id.
        key = (-total, c.peer_id, c.backend.backend_id)
        if largest is None or key < largest:
            largest = key
    if largest is None:
        return None
    total, peer_id, backend_id = -largest[0], largest[1], largest[2]
    return TooLarge(
        token=token,
        need=amount,
        count=job.device.count,
        replicas=job.device.replicas,
        peer_id=peer_id,
        backend_id=backend_id,
        largest=total,
    )
