"""A job that can never fit is rejected at submit (docs/DESIGN.md, "Classification": "Never fits";
iris/policy/sizing.py): its whole gate on one backend, against the totals the clusters report. A
backend whose total is unknown (its cluster never reported, unreachable or stale, no block, no total
for the token) never counts against a job: it queues."""

from __future__ import annotations

from budget import scaled
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from policy_factories import EPOCH, NOW, STALE, cpu_job, eq, gpu_attrs, job, peer

from iris.policy import (
    Availability,
    BackendReport,
    Band,
    Classification,
    DeviceRequest,
    Disposition,
    HeldByBand,
    JobShape,
    PeerReport,
    classify,
    gate,
    job_constraints,
    matches,
    peer_status,
    plan,
)
from iris.policy.availability import PeerStatus
from iris.policy.queue import dry_run
from iris.policy.reasons import ReasonCode
from iris.policy.sizing import Candidate, known_total, too_large

HOME = "marin"
EAST, RNO = "cw-us-east-02a", "cw-rno2a"


def sized(
    backend_id: str,
    total: int,
    *,
    free: int | None = None,
    variant: str = "h100",
    cpu: int | None = 8,
    attrs: dict[str, list[str]] | None = None,
) -> BackendReport:
    """A backend as a controller reports it: free and total chips of ``variant``, CPU slots."""
    amounts = {variant: total if free is None else free}
    totals = {variant: total}
    if cpu is not None:
        amounts["cpu"], totals["cpu"] = cpu, cpu
    return BackendReport(
        backend_id=backend_id,
        advertised_attributes=attrs or gpu_attrs(variant),
        availability=Availability(observation_epoch_ms=EPOCH, amounts=amounts, total_amounts=totals),
    )


def cpu_slots(backend_id: str, total: int) -> BackendReport:
    return BackendReport(
        backend_id=backend_id,
        advertised_attributes={"device-type": ["cpu"]},
        availability=Availability(
            observation_epoch_ms=EPOCH, amounts={"cpu": total}, total_amounts={"cpu": total}
        ),
    )


def demo(*, east: PeerReport | None = None, rno: PeerReport | None = None) -> list[PeerReport]:
    """config/clusters.toml as its clusters report: marin (2 × 8 CPU slots), cw-us-east-02a (16
    H100), cw-rno2a (8 H100); the GPU backends also run 8 CPU processes."""
    east_attrs = gpu_attrs("h100", zone="us-east-02a", preemptible="false")
    rno_attrs = gpu_attrs("h100", zone="rno2a", preemptible="true")
    return [
        peer(HOME, cpu_slots("cpu-us-central1-a", 8), cpu_slots("cpu-us-central1-b", 8)),
        east or peer(EAST, sized("h100-us-east-02a", 16, attrs=east_attrs)),
        rno or peer(RNO, sized("h100-rno2a", 8, attrs=rno_attrs)),
    ]


def run(shape: JobShape, reports: list[PeerReport], **kw: object) -> Classification:
    return classify(shape, home=HOME, reports=reports, now_ms=NOW, stale_after_ms=STALE, **kw)  # type: ignore[arg-type]


def gang(count: int, replicas: int = 1, **kw: object) -> JobShape:
    return job(count=count, replicas=replicas, **kw)  # type: ignore[arg-type]


class TestTheDemoTopology:
    def test_32_h100_is_rejected_naming_the_largest_backend(self) -> None:
        result = run(gang(32), demo())
        assert (result.disposition, result.code) == (Disposition.REJECT, ReasonCode.TooLarge)
        assert result.reason == (
            "no backend can ever hold it: needs 32 h100 on one backend; "
            "the largest matching is cw-us-east-02a/h100-us-east-02a with 16"
        )

    def test_three_replicas_of_8_are_a_gang_of_24_on_one_backend(self) -> None:
        result = run(gang(8, replicas=3), demo())
        assert (result.disposition, result.code) == (Disposition.REJECT, ReasonCode.TooLarge)
        assert result.reason == (
            "no backend can ever hold it: needs 24 h100 on one backend (3 replicas × 8); "
            "the largest matching is cw-us-east-02a/h100-us-east-02a with 16"
        )

    def test_what_the_largest_backend_holds_queues(self) -> None:
        for shape in (gang(16), gang(8, replicas=2), gang(8), gang(1)):
            result = run(shape, demo())
            assert result.disposition is Disposition.QUEUE and result.code is None, shape.device

    def test_a_full_backend_large_enough_queues(self) -> None:
        east = peer(EAST, sized("h100-us-east-02a", 16, free=0))
        assert run(gang(16), demo(east=east)).disposition is Disposition.QUEUE

    def test_only_backends_of_the_jobs_shape_count(self) -> None:
        # Only cw-rno2a is in zone rno2a: the largest matching is its 8, not cw-us-east-02a's 16.
        result = run(gang(16, constraints=(eq("zone", "rno2a"),)), demo())
        assert result.code is ReasonCode.TooLarge
        assert result.reason.endswith("the largest matching is cw-rno2a/h100-rno2a with 8")

    def test_no_backend_of_the_shape_is_still_a_shape_mismatch(self) -> None:
        result = run(gang(64, variant="b200"), demo())
        assert result.disposition is Disposition.REJECT and result.code is None
        assert result.reason == "no backend in the federation satisfies device-variant=b200"

    def test_cpu_replicas_are_one_slot_each_on_one_backend(self) -> None:
        assert run(cpu_job(replicas=8), demo()).disposition is Disposition.LOCAL
        result = run(cpu_job(replicas=9), demo())
        assert result.code is ReasonCode.TooLarge
        assert result.reason == (
            "no backend can ever hold it: needs 9 cpu on one backend; "
            "the largest matching is cw-rno2a/h100-rno2a with 8"
        )

    def test_ungated_jobs_are_never_measured(self) -> None:
        tpu = JobShape(job_id="a/t", device=DeviceRequest(type="tpu", variant="tpu-v5p", count=4096))
        auto = JobShape(job_id="a/g", device=DeviceRequest(type="gpu", variant="auto", count=4096))
        tpu_attrs = {"device-type": ["tpu"], "device-variant": ["tpu-v5p"]}
        tpu_peer = peer("cw-tpu", BackendReport(backend_id="t", advertised_attributes=tpu_attrs))
        assert run(tpu, [*demo(), tpu_peer]).disposition is Disposition.QUEUE
        assert run(auto, demo()).disposition is Disposition.QUEUE

    def test_runs_that_predate_it_still_queue(self) -> None:
        result = run(gang(32), demo(), reject_too_large=False)
        assert (result.disposition, result.code) == (Disposition.QUEUE, None)


class TestUnknownIsNeverGroundsForARejection:
    def test_a_peer_that_never_reported_queues_the_job(self) -> None:
        never = PeerReport(peer_id=RNO, reachable=True, last_contact_ms=None)
        configured = {RNO: [BackendReport(backend_id="h100-rno2a", advertised_attributes=gpu_attrs())]}
        result = run(gang(32), demo(rno=never), configured=configured)
        assert result.disposition is Disposition.QUEUE
        assert "only cw-rno2a stale can run it" not in result.reason  # cw-us-east-02a has the shape

    def test_an_unreachable_peer_as_configured_queues_the_job(self) -> None:
        down = PeerReport(peer_id=RNO, reachable=False, error="connection refused")
        configured = {RNO: [BackendReport(backend_id="h100-rno2a", advertised_attributes=gpu_attrs())]}
        assert run(gang(32), demo(rno=down), configured=configured).disposition is Disposition.QUEUE

    def test_a_stale_report_s_totals_are_not_trusted(self) -> None:
        stale = peer(RNO, sized("h100-rno2a", 8), last_contact_ms=NOW - STALE - 1)
        assert run(gang(32), demo(rno=stale)).disposition is Disposition.QUEUE

    def test_a_shape_only_backend_queues_the_job(self) -> None:
        legacy = peer(RNO, BackendReport(backend_id="legacy", advertised_attributes=gpu_attrs()))
        assert run(gang(32), demo(rno=legacy)).disposition is Disposition.QUEUE
        newer = sized("v2", 8).model_copy(
            update={"availability": Availability(version=2, total_amounts={"h100": 8})}
        )
        assert run(gang(32), demo(rno=peer(RNO, newer))).disposition is Disposition.QUEUE

    def test_a_block_without_a_total_for_the_token_queues_the_job(self) -> None:
        block = Availability(observation_epoch_ms=EPOCH, amounts={"h100": 8}, total_amounts={})
        no_total = BackendReport(backend_id="b", advertised_attributes=gpu_attrs(), availability=block)
        quiet = peer(RNO, no_total)
        assert run(gang(32), demo(rno=quiet)).disposition is Disposition.QUEUE
        # A CPU job on backends that report no CPU slots at all: not measured.
        devices_only = [
            peer(HOME, BackendReport(backend_id="c", advertised_attributes={"device-type": ["cpu"]})),
        ]
        assert run(cpu_job(replicas=64), devices_only).disposition is Disposition.LOCAL

    def test_a_non_matching_backend_s_unknown_total_does_not_matter(self) -> None:
        legacy_a100 = peer("cw-a100", BackendReport(backend_id="a", advertised_attributes=gpu_attrs("a100")))
        assert run(gang(32), [*demo(), legacy_a100]).code is ReasonCode.TooLarge


class TestPins:
    def test_pinned_against_its_cluster_s_backends(self) -> None:
        result = run(gang(16, pin=RNO), demo())
        assert (result.disposition, result.pinned_cluster, result.code) == (
            Disposition.REJECT,
            RNO,
            ReasonCode.TooLarge,
        )
        assert result.reason.endswith("the largest matching is cw-rno2a/h100-rno2a with 8")
        assert run(gang(16, pin=EAST), demo()).disposition is Disposition.QUEUE

    def test_pinned_to_a_peer_that_is_down_queues(self) -> None:
        down = PeerReport(peer_id=RNO, reachable=False)
        result = run(gang(16, pin=RNO), demo(rno=down))
        assert (result.disposition, result.pinned_cluster) == (Disposition.QUEUE, RNO)

    def test_pinned_to_a_peer_without_the_shape_is_still_force_routed(self) -> None:
        result = run(gang(64, variant="b200", pin=RNO), demo())
        assert (result.disposition, result.pinned_cluster) == (Disposition.QUEUE, RNO)

    def test_pinned_home(self) -> None:
        result = run(cpu_job(replicas=9, pin=HOME), demo())
        assert (result.disposition, result.pinned_cluster, result.code) == (
            Disposition.REJECT,
            HOME,
            ReasonCode.TooLarge,
        )
        assert result.reason.endswith("the largest matching is marin/cpu-us-central1-a with 8")
        assert run(cpu_job(replicas=8, pin=HOME), demo()).disposition is Disposition.LOCAL


def test_the_dry_run_says_the_same() -> None:
    for shape in (gang(32), gang(8, replicas=3)):
        report = dry_run(shape, home=HOME, reports=demo(), queue=[], now_ms=NOW, stale_after_ms=STALE)
        decision = run(shape, demo())
        assert report.rejected and report.code is ReasonCode.TooLarge
        assert report.classification == decision.reason
        assert report.placement is None and report.waiting is None
    queued = dry_run(gang(16), home=HOME, reports=demo(), queue=[], now_ms=NOW, stale_after_ms=STALE)
    assert not queued.rejected and queued.placement is not None


def test_known_totals_are_read_as_the_capacity_block_reads_them() -> None:
    block = Availability(observation_epoch_ms=EPOCH, total_amounts={"H100": 8, " h100": 8, "a100": -4})
    b = BackendReport(backend_id="b", advertised_attributes=gpu_attrs(), availability=block)
    assert (known_total(b, "h100"), known_total(b, "a100"), known_total(b, "b200")) == (16, 0, None)


# ---- properties over random federations ----------------------------------------------------------

STATES = ("ok", "ok", "ok", "ok", "down", "stale", "never")


@st.composite
def backends(draw: st.DrawFn, backend_id: str) -> BackendReport:
    variant = draw(st.sampled_from(("h100", "a100")))
    attrs = gpu_attrs(variant, region=draw(st.sampled_from(("east", "west"))))
    kind = draw(st.sampled_from(("sized",) * 5 + ("no-total", "legacy", "newer")))
    if kind == "legacy":
        return BackendReport(backend_id=backend_id, advertised_attributes=attrs)
    total = draw(st.integers(0, 32))
    free = draw(st.integers(0, total))
    held = draw(st.integers(0, total - free))
    block = Availability(
        version=2 if kind == "newer" else 1,
        observation_epoch_ms=EPOCH,
        amounts={variant: free},
        total_amounts={} if kind == "no-total" else {variant: total},
        held_by_band=[HeldByBand(band=Band.BATCH, amounts={variant: held})] if held else [],
    )
    return BackendReport(backend_id=backend_id, advertised_attributes=attrs, availability=block)


@st.composite
def federations(draw: st.DrawFn) -> list[PeerReport]:
    reports = [peer(HOME, cpu_slots("cpu", 8))]
    for i in range(draw(st.integers(1, 3))):
        state = draw(st.sampled_from(STATES))
        names = [f"b{j}" for j in range(draw(st.integers(0, 2)))]
        found = [draw(backends(n)) for n in names]
        if state == "down":
            reports.append(PeerReport(peer_id=f"cw-{i}", reachable=False))
        elif state == "never":
            reports.append(PeerReport(peer_id=f"cw-{i}", last_contact_ms=None, backends=found))
        else:
            last = NOW - STALE - 1 if state == "stale" else NOW - 10
            reports.append(peer(f"cw-{i}", *found, last_contact_ms=last))
    return reports


@st.composite
def gangs(draw: st.DrawFn) -> JobShape:
    constraints = draw(st.sampled_from(((), (eq("region", "east"),))))
    return job(
        "alice/gang",
        variant=draw(st.sampled_from(("h100", "a100"))),
        count=draw(st.integers(1, 24)),
        replicas=draw(st.integers(1, 3)),
        band=draw(st.sampled_from(list(Band))),
        constraints=constraints,
        pin=draw(st.sampled_from((None, None, None, "cw-0"))),
    )


def reference(shape: JobShape, reports: list[PeerReport]) -> bool:
    """Plain loops: rejected as too large exactly when some backend has the job's shape, and every
    such backend (on the pin if pinned) belongs to an OK cluster and reports a total below the need."""
    need = gate(shape.device)
    assert need is not None
    token, amount = need
    totals: list[int | None] = []
    for report in reports:
        if shape.target_cluster and report.peer_id != shape.target_cluster:
            continue
        ok = peer_status(report, NOW, STALE) is PeerStatus.OK
        for b in report.backends:
            if not matches(job_constraints(shape), b.advertised_attributes):
                continue
            block = b.availability
            if not ok or block is None or block.version != 1 or token not in block.total_amounts:
                totals.append(None)
            else:
                totals.append(block.total_amounts[token])
    return bool(totals) and all(t is not None and t < amount for t in totals)


PROPERTIES = settings(max_examples=scaled(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTIES
@given(gangs(), federations())
def test_rejected_exactly_when_every_matching_backend_is_known_and_too_small(
    shape: JobShape, reports: list[PeerReport]
) -> None:
    result = run(shape, reports)
    assert (result.code is ReasonCode.TooLarge) == reference(shape, reports)
    if result.code is ReasonCode.TooLarge:
        assert result.disposition is Disposition.REJECT
        need = gate(shape.device)
        assert need is not None
        # The named backend is a matching one with the largest total of them.
        named = next(
            b
            for r in reports
            for b in r.backends
            if result.reason.endswith(f"is {r.peer_id}/{b.backend_id} with {known_total(b, need[0])}")
        )
        assert matches(job_constraints(shape), named.advertised_attributes)


@PROPERTIES
@given(gangs(), federations())
def test_a_rejected_job_is_one_no_tick_could_ever_place(shape: JobShape, reports: list[PeerReport]) -> None:
    """Soundness against the planner: even with every backend idle (each block's free set to its
    total, nothing held, no ledger), the tick places a job rejected as too large nowhere."""
    if run(shape, reports).code is not ReasonCode.TooLarge:
        return
    idle: list[PeerReport] = []
    for r in reports:
        emptied = []
        for b in r.backends:
            block = b.availability
            if block is not None:
                block = block.model_copy(update={"amounts": dict(block.total_amounts), "held_by_band": []})
            emptied.append(b.model_copy(update={"availability": block}))
        idle.append(r.model_copy(update={"backends": emptied}))
    result = plan([shape], home=HOME, reports=idle, reservations=[], now_ms=NOW, stale_after_ms=STALE)
    assert result.placement_for(shape.job_id) is None


def test_too_large_ignores_candidates_of_another_shape() -> None:
    a100 = Candidate(peer_id="x", backend=sized("a", 64, variant="a100"), trusted=True)
    small = Candidate(peer_id="y", backend=sized("h", 8), trusted=True)
    verdict = too_large(gang(16), [a100, small])
    assert verdict is not None and (verdict.peer_id, verdict.largest) == ("y", 8)
    assert too_large(gang(16), [a100]) is None  # no backend of the shape: not this module's verdict
