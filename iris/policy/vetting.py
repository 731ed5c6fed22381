"""A placement re-checked whoever sent it (docs/DESIGN.md, "Promotion (the CAS)"; docs/SECURITY.md,
"Internal signals").

The tick tells a queued job where to go with a ``place`` signal, and anyone who reaches Temporal can
send one. So the job workflow does not promote what the signal says: it promotes what
``vet_placement`` derives from it. The signal only names a cluster and a backend; whether that
backend satisfies the job's constraints and pin, and what the promotion reserves in the ledger, come
from the federation view (the backends the workflow knows of that cluster) and the job's own shape:

- a placement for another job, or off the job's pin, is refused;
- a named backend must be one the view knows on that cluster, and satisfy every routing constraint
  of the job (device, region, zone, preemptible, …);
- a force-routed placement (no backend) is for a job pinned to that cluster only; if the cluster has
  a backend of the job's shape after all, the placement goes to it (its reservation taken), never
  past the ledger;
- a gated job (``gate``) reserves its whole need whenever the backend's capacity block verifies it,
  or the offer reserved anything: whatever amount the signal claimed. A shape-only backend (no
  block) reserves nothing, as the tick's own placement would.

``Vetting.vouched`` is False when a fresher view could decide otherwise (a backend the view does not
know, constraints its attributes fail, a force-routing, a gated job on a backend the view cannot
verify): the workflow then reads the reports again and vets once more.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel

from iris.policy.availability import gate, is_verified, usable_block, working_capacity
from iris.policy.classify import pick_backend
from iris.policy.models import BackendReport, JobShape, PeerReport, Placement
from iris.policy.routing import first_unmatched, job_constraints, matches

# How much of an offer's free-text reason a promotion's event keeps.
MAX_REASON_CHARS = 200


class Vetting(BaseModel):
    """What to promote (``placement``), or why the offer is refused (``refusal``); ``vouched``:
    the view the verdict was reached on leaves nothing a fresher one could change."""

    placement: Placement | None = None
    refusal: str | None = None
    vouched: bool = True


def _refused(why: str, *, vouched: bool = True) -> Vetting:
    return Vetting(refusal=why, vouched=vouched)


def vet_placement(
    job: JobShape, offer: Placement, *, pin: str | None, backends: Sequence[BackendReport]
) -> Vetting:
    """The placement to promote ``job`` with, derived from ``offer`` (a ``place`` signal's), or why
    it is refused. ``pin`` is the job's resolved pin (None: unpinned); ``backends`` are the backends
    the federation view knows on ``offer.peer_id`` (its report's, else as configured)."""
    peer = offer.peer_id
    if offer.job_id and offer.job_id != job.job_id:
        return _refused(f"it is for job {offer.job_id[:80]!r}")
    if pin is not None and peer != pin:
        return _refused(f"the job is pinned to {pin}")
    constraints = job_constraints(job)
    backend_id = offer.backend_id
    if not backend_id:
        if pin is None:
            return _refused("a force-routed placement is only for a job pinned to that cluster")
        if not any(matches(constraints, b.advertised_attributes) for b in backends):
            # The pinned cluster has no backend of the job's shape (or none known): its controller
            # decides.
            forced = Placement(
                job_id=job.job_id,
                peer_id=peer,
                backend_id="",
                band=job.band,
                verified=False,
                forced=True,
                reason=offer.reason[:MAX_REASON_CHARS],
            )
            return Vetting(placement=forced, vouched=False)
        chosen = pick_backend(job, PeerReport(peer_id=peer, backends=list(backends)))
        assert chosen is not None  # a backend matches
        verdict = _to_backend(job, offer, peer, chosen, backends)
        return verdict.model_copy(update={"vouched": False})
    return _to_backend(job, offer, peer, backend_id, backends)


def _to_backend(
    job: JobShape, offer: Placement, peer: str, backend_id: str, backends: Sequence[BackendReport]
) -> Vetting:
    backend = next((b for b in backends if b.backend_id == backend_id), None)
    if backend is None:
        return _refused(f"{peer} has no backend {backend_id[:80]!r} in the federation view", vouched=False)
    unmet = first_unmatched(job_constraints(job), backend.advertised_attributes)
    if unmet is not None:
        return _refused(f"{peer}/{backend_id} does not satisfy {unmet.describe()}", vouched=False)
    need = gate(job.device)
    block = usable_block(backend)
    verified = is_verified(working_capacity(peer, backend), need[0] if need else None)
    reserved: dict[str, int] = {}
    observation = block.observation_epoch_ms if block is not None else offer.observation_epoch_ms
    if need is not None and (verified or offer.reserved):
        reserved = {need[0]: need[1]}
        if observation is None:
            observation = offer.observation_epoch_ms or 0
    placement = Placement(
        job_id=job.job_id,
        peer_id=peer,
        backend_id=backend_id,
        band=job.band,
        observation_epoch_ms=observation,
        reserved=reserved,
        verified=verified,
        preempts=offer.preempts,
        reason=offer.reason[:MAX_REASON_CHARS],
        # Backfilled ahead of this job (docs/DESIGN.md, "Backfill"): only the event's code reads it.
        ahead_of=offer.ahead_of[:MAX_REASON_CHARS] if offer.ahead_of else None,
    )
    # A gated job on a backend the view cannot verify: a fresher view may show its block.
    return Vetting(placement=placement, vouched=need is None or verified)


__all__ = ["MAX_REASON_CHARS", "Vetting", "vet_placement"]
