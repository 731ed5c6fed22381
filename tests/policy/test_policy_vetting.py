"""A placement re-checked whoever sent it (iris/policy/vetting.py; docs/SECURITY.md, "Internal
signals"): the ``place`` signal names a cluster and a backend, and the job promotes only what its
constraints, its pin and the ledger allow there. Named cases (the forged placements of issue 26),
then properties over random federations: nothing vetted breaks a constraint, a pin or the job's
reservation, and every placement the tick itself makes is accepted as the tick made it."""

from __future__ import annotations

from hypothesis import given
from policy_factories import backend, gpu_attrs
from test_policy_properties import SETTINGS, Scenario, job_shapes, run, scenarios

from iris.policy import (
    BackendReport,
    Constraint,
    DeviceRequest,
    JobShape,
    Op,
    Placement,
    job_constraints,
    matches,
    pinned_cluster,
    vet_placement,
)
from iris.policy.availability import gate
from iris.policy.vetting import MAX_REASON_CHARS

EAST = "cw-us-east-02a"
RNO = "cw-rno2a"
# The demo's two GPU peers (config/clusters.toml): the east one in zone us-east-02a, on-demand;
# cw-rno2a's pool is preemptible, in another zone.
EAST_H100 = backend(
    "h100-east", gpu_attrs(zone="us-east-02a", region="us-east", preemptible="false"), free={"h100": 16}
)
RNO_H100 = backend(
    "h100-rno", gpu_attrs(zone="us-west-04a", region="us-west", preemptible="true"), free={"h100": 8}
)
SHAPE_ONLY = backend("h100-legacy", gpu_attrs(zone="us-east-02a"), legacy=True)


def job(**kw: object) -> JobShape:
    """8 × H100 in zone us-east-02a, not preemptible (`--zone us-east-02a --no-preemptible`)."""
    fields: dict[str, object] = {
        "job_id": "alice/train",
        "device": DeviceRequest(type="gpu", variant="h100", count=8),
        "constraints": (
            Constraint(key="zone", op=Op.EQ, values=("us-east-02a",)),
            Constraint(key="preemptible", op=Op.EQ, values=("false",)),
        ),
    }
    fields.update(kw)
    return JobShape.model_validate(fields)


def offer(peer: str, backend_id: str, **kw: object) -> Placement:
    return Placement(job_id="alice/train", peer_id=peer, backend_id=backend_id, **kw)  # type: ignore[arg-type]


def test_a_placement_on_a_backend_that_breaks_a_constraint_is_refused() -> None:
    """Issue 26: `place` sent a `--zone us-east-02a --no-preemptible` job to cw-rno2a."""
    verdict = vet_placement(job(), offer(RNO, "h100-rno"), pin=None, backends=[RNO_H100])
    assert verdict.placement is None
    assert verdict.refusal == f"{RNO}/h100-rno does not satisfy zone=us-east-02a"
    # Not vouched: the workflow reads the reports again before it ignores the offer.
    assert not verdict.vouched


def test_a_placement_off_the_pin_for_another_job_or_on_an_unknown_backend_is_refused() -> None:
    assert vet_placement(job(), offer(EAST, "h100-east"), pin=RNO, backends=[EAST_H100]).refusal == (
        f"the job is pinned to {RNO}"
    )
    other = offer(EAST, "h100-east").model_copy(update={"job_id": "bob/train"})
    assert vet_placement(job(), other, pin=None, backends=[EAST_H100]).refusal == "it is for job 'bob/train'"
    unknown = vet_placement(job(), offer(EAST, "h100-x"), pin=None, backends=[EAST_H100])
    assert unknown.refusal == f"{EAST} has no backend 'h100-x' in the federation view"
    assert not unknown.vouched


def test_the_reservation_is_the_jobs_whatever_the_offer_claims() -> None:
    """A forged placement that reserves nothing (or 1 of 8 chips) still takes the job's 8 chips."""
    for claimed in ({}, {"h100": 1}, {"cpu": 64}):
        verdict = vet_placement(
            job(), offer(EAST, "h100-east", reserved=claimed), pin=None, backends=[EAST_H100]
        )
        assert verdict.placement is not None and verdict.vouched
        assert verdict.placement.reserved == {"h100": 8}
        assert verdict.placement.observation_epoch_ms == EAST_H100.availability.observation_epoch_ms  # type: ignore[union-attr]


def test_a_shape_only_backend_reserves_nothing_unless_the_tick_did() -> None:
    plain = vet_placement(job(constraints=()), offer(EAST, "h100-legacy"), pin=None, backends=[SHAPE_ONLY])
    assert plain.placement is not None and plain.placement.reserved == {}
    # The view cannot verify the block: a fresher one may.
    assert not plain.vouched
    ticked = offer(EAST, "h100-legacy", reserved={"h100": 8}, observation_epoch_ms=5)
    charged = vet_placement(job(constraints=()), ticked, pin=None, backends=[SHAPE_ONLY])
    assert charged.placement is not None and charged.placement.reserved == {"h100": 8}


def test_a_force_routing_is_for_a_pinned_job_and_never_skips_a_matching_backend() -> None:
    forced = offer(EAST, "", forced=True)
    assert vet_placement(job(), forced, pin=None, backends=[EAST_H100]).refusal == (
        "a force-routed placement is only for a job pinned to that cluster"
    )
    # Pinned, and the cluster has a backend of the job's shape: promoted there, with its chips.
    verdict = vet_placement(job(), forced, pin=EAST, backends=[EAST_H100])
    assert verdict.placement is not None
    assert (verdict.placement.backend_id, verdict.placement.reserved) == ("h100-east", {"h100": 8})
    assert not verdict.placement.forced
    # Pinned to a cluster without the shape: force-routed, its controller decides.
    bare = vet_placement(job(), offer(RNO, "", forced=True), pin=RNO, backends=[RNO_H100])
    assert bare.placement is not None and bare.placement.forced and bare.placement.reserved == {}


# ---- properties -----------------------------------------------------------------------------------


def _backends(s: Scenario, peer: str) -> list[BackendReport]:
    report = next((r for r in s[1] if r.peer_id == peer), None)
    return list(report.backends) if report is not None else []


@SETTINGS
@given(scenarios())
def test_every_placement_the_tick_makes_is_accepted_as_it_made_it(s: Scenario) -> None:
    jobs = {j.job_id: j for j in s[0]}
    ids = [r.peer_id for r in s[1]]
    for made in run(s).placements:
        shape = jobs[made.job_id]
        pin = pinned_cluster(shape.target_cluster, ids)
        verdict = vet_placement(shape, made, pin=pin, backends=_backends(s, made.peer_id))
        assert verdict.placement is not None, verdict.refusal
        got = verdict.placement
        if made.forced:
            assert got.forced and got.backend_id == "" and got.reserved == {}
            continue
        assert (got.peer_id, got.backend_id, got.band) == (made.peer_id, made.backend_id, shape.band)
        assert got.reserved == made.reserved


@SETTINGS
@given(scenarios(), job_shapes("alice/vetted", ["marin", "cw-0", "cw-1", "cw-2"]))
def test_nothing_vetted_breaks_a_constraint_a_pin_or_the_jobs_reservation(
    s: Scenario, shape: JobShape
) -> None:
    ids = [r.peer_id for r in s[1]]
    pin = pinned_cluster(shape.target_cluster, ids)
    need = gate(shape.device)
    for report in s[1]:
        for named in [*(b.backend_id for b in report.backends), "", "nowhere"]:
            for claimed in ({}, {"h100": 1}):
                forged = Placement(
                    job_id=shape.job_id,
                    peer_id=report.peer_id,
                    backend_id=named,
                    reserved=claimed,
                    forced=not named,
                )
                verdict = vet_placement(shape, forged, pin=pin, backends=list(report.backends))
                assert (verdict.placement is None) != (verdict.refusal is None)
                got = verdict.placement
                if got is None:
                    continue
                assert got.job_id == shape.job_id and got.band == shape.band
                assert pin is None or got.peer_id == pin
                if got.forced:
                    # Only a pinned job, only where no backend has its shape.
                    assert pin == report.peer_id and got.reserved == {}
                    assert not any(
                        matches(job_constraints(shape), b.advertised_attributes) for b in report.backends
                    )
                    continue
                chosen = next(b for b in report.backends if b.backend_id == got.backend_id)
                assert matches(job_constraints(shape), chosen.advertised_attributes)
                # Never less than the job's need, never anything else.
                assert got.reserved in ({}, {need[0]: need[1]} if need else {})
                if need is not None and (claimed or got.verified):
                    assert got.reserved == {need[0]: need[1]}


def test_a_backfilled_offer_keeps_the_job_it_went_ahead_of_bounded() -> None:
    """The promotion's event code reads it (docs/DESIGN.md, "Backfill"); a long one is cut."""
    kept = vet_placement(job(), offer(EAST, "h100-east", ahead_of="bob/gang"), pin=None, backends=[EAST_H100])
    assert kept.placement is not None and kept.placement.ahead_of == "bob/gang"
    plain = vet_placement(job(), offer(EAST, "h100-east"), pin=None, backends=[EAST_H100])
    assert plain.placement is not None and plain.placement.ahead_of is None
    long = vet_placement(job(), offer(EAST, "h100-east", ahead_of="x" * 5000), pin=None, backends=[EAST_H100])
    assert long.placement is not None and long.placement.ahead_of == "x" * MAX_REASON_CHARS
