"""The placement tick (docs/DESIGN.md, "The tick"): one named test per rule and edge case."""

from __future__ import annotations

import random

from policy_factories import EPOCH, NOW, STALE, backend, cpu_backend, cpu_job, eq, gpu_attrs, h100, job, peer

from iris.policy import (
    Band,
    JobShape,
    PeerReport,
    PlanRequest,
    PlanResult,
    Reservation,
    WaitKind,
    plan,
    plan_reference,
    plan_request,
)


def tick(
    jobs: list[JobShape],
    *reports: PeerReport,
    reservations: list[Reservation] | None = None,
    cap: int | None = None,
    now_ms: int = NOW,
) -> PlanResult:
    kwargs = {
        "home": "marin",
        "reports": list(reports),
        "reservations": reservations or [],
        "now_ms": now_ms,
        "stale_after_ms": STALE,
        "max_per_peer": cap,
    }
    result = plan(jobs, **kwargs)  # type: ignore[arg-type]
    # Every named scenario also pins the fast planner to the reference.
    assert result == plan_reference(jobs, **kwargs)  # type: ignore[arg-type]
    return result


def where(result: PlanResult) -> dict[str, tuple[str, str]]:
    return {p.job_id: (p.peer_id, p.backend_id) for p in result.placements}


def waiting_ids(result: PlanResult) -> list[str]:
    return [j for g in result.waiting for j in g.job_ids]


HOME_CPU = peer("marin", cpu_backend("cpu-a"))


class TestOrderAndFit:
    def test_queue_order_is_band_then_submit_time(self) -> None:
        jobs = [
            job("batch-early", band=Band.BATCH, submit_ms=1),
            job("inter-late", band=Band.INTERACTIVE, submit_ms=9),
            job("prod-latest", band=Band.PRODUCTION, submit_ms=20),
            job("inter-early", band=Band.INTERACTIVE, submit_ms=2),
        ]
        result = tick(jobs, HOME_CPU, peer("cw", h100("b", 64)))
        assert [p.job_id for p in result.placements] == [
            "prod-latest",
            "inter-early",
            "inter-late",
            "batch-early",
        ]

    def test_higher_band_takes_the_last_capacity(self) -> None:
        jobs = [job("batch", band=Band.BATCH, submit_ms=0), job("prod", band=Band.PRODUCTION, submit_ms=5)]
        result = tick(jobs, HOME_CPU, peer("cw", h100("b", 8)))
        assert where(result) == {"prod": ("cw", "b")}
        assert waiting_ids(result) == ["batch"]

    def test_three_replicas_of_8_h100_gate_is_24(self) -> None:
        shape = job("big", replicas=3)
        assert where(tick([shape], HOME_CPU, peer("cw", h100("b", 23)))) == {}
        placed = tick([shape], HOME_CPU, peer("cw", h100("b", 24)))
        assert where(placed) == {"big": ("cw", "b")}
        assert placed.placements[0].reserved == {"h100": 24}

    def test_capacity_is_never_summed_across_backends(self) -> None:
        result = tick([job("j", count=16)], HOME_CPU, peer("cw", h100("a", 8), h100("b", 8)))
        assert where(result) == {}
        explanation = result.explain("j")
        assert explanation is not None
        verdict = explanation.for_peer("cw")
        assert verdict is not None and verdict.available == 8

    def test_tightest_fit_wins(self) -> None:
        result = tick([job("j")], HOME_CPU, peer("big", h100("b", 64)), peer("snug", h100("b", 9)))
        assert where(result) == {"j": ("snug", "b")}

    def test_ties_break_on_peer_id_then_backend_id(self) -> None:
        result = tick(
            [job("j")], HOME_CPU, peer("cw-b", h100("x", 8)), peer("cw-a", h100("z", 8), h100("y", 8))
        )
        assert where(result) == {"j": ("cw-a", "y")}

    def test_ties_ignore_report_order(self) -> None:
        home = peer("marin", cpu_backend("z"), cpu_backend("b"), backend("y", gpu_attrs(), legacy=True))
        legacy = peer("cw", backend("z", gpu_attrs(), legacy=True), backend("c", gpu_attrs(), legacy=True))
        result = tick([cpu_job("c"), job("g")], home, legacy)
        assert where(result) == {"c": ("marin", "b"), "g": ("marin", "y")}
        result = tick([job("g")], HOME_CPU, legacy)
        assert where(result) == {"g": ("cw", "c")}

    def test_two_equal_peers_spread_two_jobs(self) -> None:
        result = tick(
            [job("one", submit_ms=1), job("two", submit_ms=2)],
            HOME_CPU,
            peer("a", h100("b", 8)),
            peer("c", h100("b", 8)),
        )
        assert where(result) == {"one": ("a", "b"), "two": ("c", "b")}

    def test_in_tick_decrement_never_double_books(self) -> None:
        jobs = [job(f"j{i}", submit_ms=i) for i in range(3)]
        result = tick(jobs, HOME_CPU, peer("cw", h100("b", 16)))
        assert sorted(where(result)) == ["j0", "j1"]
        assert waiting_ids(result) == ["j2"]

    def test_no_head_of_line_blocking(self) -> None:
        jobs = [job("huge", count=64, submit_ms=0), job("small", count=8, submit_ms=1)]
        result = tick(jobs, HOME_CPU, peer("cw", h100("b", 8)))
        assert where(result) == {"small": ("cw", "b")}
        assert waiting_ids(result) == ["huge"]

    def test_job_is_never_split_across_backends_or_peers(self) -> None:
        result = tick([job("j", count=12)], HOME_CPU, peer("a", h100("x", 8)), peer("b", h100("y", 8)))
        assert result.placements == []


class TestHomeFirst:
    def test_home_before_peers_among_equal_fits(self) -> None:
        result = tick([job("j")], peer("marin", h100("h", 8)), peer("cw", h100("b", 8)))
        assert where(result) == {"j": ("marin", "h")}

    def test_home_beats_a_tighter_peer(self) -> None:
        result = tick([job("j")], peer("marin", h100("h", 64)), peer("cw", h100("b", 8)))
        assert where(result) == {"j": ("marin", "h")}

    def test_queued_job_home_could_host_goes_to_a_peer_with_room_first(self) -> None:
        full_home = peer("marin", h100("h", 0))
        result = tick([job("j")], full_home, peer("cw", h100("b", 8)))
        assert where(result) == {"j": ("cw", "b")}

    def test_queued_job_is_placed_at_home_once_home_reports_room(self) -> None:
        busy_peer = peer("cw", h100("b", 0))
        first = tick([job("j")], peer("marin", h100("h", 0)), busy_peer)
        assert where(first) == {}
        later = peer("marin", h100("h", 8, epoch=EPOCH + 10_000))
        assert where(tick([job("j")], later, busy_peer)) == {"j": ("marin", "h")}

    def test_ungated_jobs_prefer_home(self) -> None:
        result = tick([cpu_job("c")], peer("cw", cpu_backend("x")), peer("marin", cpu_backend("y")))
        assert where(result) == {"c": ("marin", "y")}


class TestBands:
    def test_interactive_job_reaches_a_peer_saturated_by_batch(self) -> None:
        result = tick([job("j")], HOME_CPU, peer("cw", h100("b", 0, held={Band.BATCH: 16})))
        assert where(result) == {"j": ("cw", "b")}
        assert result.placements[0].preempts

    def test_batch_reclaims_nothing(self) -> None:
        result = tick([job("j", band=Band.BATCH)], HOME_CPU, peer("cw", h100("b", 0, held={Band.BATCH: 16})))
        assert where(result) == {}

    def test_no_job_reclaims_its_own_band_or_higher(self) -> None:
        saturated = peer("cw", h100("b", 0, held={Band.INTERACTIVE: 8, Band.PRODUCTION: 8}))
        assert where(tick([job("j")], HOME_CPU, saturated)) == {}
        assert where(tick([job("p", band=Band.PRODUCTION)], HOME_CPU, saturated)) == {"p": ("cw", "b")}

    def test_idle_peer_beats_one_needing_preemption(self) -> None:
        preempt = peer("a-preempt", h100("b", 0, held={Band.BATCH: 8}))
        idle = peer("z-idle", h100("b", 64))
        assert where(tick([job("j")], HOME_CPU, preempt, idle)) == {"j": ("z-idle", "b")}

    def test_idle_peer_beats_preempting_at_home(self) -> None:
        home = peer("marin", h100("h", 0, held={Band.BATCH: 8}))
        assert where(tick([job("j")], home, peer("cw", h100("b", 8)))) == {"j": ("cw", "b")}

    def test_8_free_plus_8_reclaimable_hosts_two_8gpu_jobs_not_three(self) -> None:
        jobs = [job(f"j{i}", submit_ms=i) for i in range(3)]
        result = tick(jobs, HOME_CPU, peer("cw", h100("b", 8, held={Band.BATCH: 8})))
        assert [(p.job_id, p.preempts) for p in result.placements] == [("j0", False), ("j1", True)]
        assert waiting_ids(result) == ["j2"]


class TestVerification:
    def test_verified_capacity_beats_shape_only(self) -> None:
        legacy = peer("a-legacy", backend("b", gpu_attrs("h100"), legacy=True))
        verified = peer("z-verified", h100("b", 8))
        result = tick([job("j")], HOME_CPU, legacy, verified)
        assert where(result) == {"j": ("z-verified", "b")}
        assert result.placements[0].verified

    def test_verified_preemption_beats_shape_only(self) -> None:
        legacy = peer("a-legacy", backend("b", gpu_attrs("h100"), legacy=True))
        preempt = peer("z", h100("b", 0, held={Band.BATCH: 8}))
        assert where(tick([job("j")], HOME_CPU, legacy, preempt)) == {"j": ("z", "b")}

    def test_shape_only_backend_hosts_when_nothing_verified_fits_and_reserves_nothing(self) -> None:
        legacy = peer("cw", backend("b", gpu_attrs("h100"), legacy=True))
        result = tick([job("j")], HOME_CPU, legacy, peer("full", h100("b", 0)))
        assert where(result) == {"j": ("cw", "b")}
        placement = result.placements[0]
        assert (placement.verified, placement.reserved, placement.reservation()) == (False, {}, None)

    def test_unknown_version_is_shape_only(self) -> None:
        newer = peer("cw", backend("b", gpu_attrs("h100"), free={}, version=2))
        assert where(tick([job("j")], HOME_CPU, newer)).get("j") == ("cw", "b")

    def test_empty_amounts_means_nothing_free(self) -> None:
        empty = peer("cw", backend("b", gpu_attrs("h100"), free={}))
        assert where(tick([job("j")], HOME_CPU, empty)) == {}

    def test_tpu_and_auto_variant_jobs_are_not_gated(self) -> None:
        tpu_attrs = {"device-type": ["tpu"], "device-variant": ["tpu-v5p"]}
        tpu = job("tpu", variant="tpu-v5p", device_type="tpu", count=4)
        auto = job("auto", variant=None, device_type="gpu", count=8)
        result = tick([tpu, auto], HOME_CPU, peer("cw", backend("t", tpu_attrs, free={}), h100("g", 0)))
        assert where(result) == {"tpu": ("cw", "t"), "auto": ("cw", "g")}
        assert all(p.reserved == {} for p in result.placements)


class TestLedger:
    def test_confirmed_reservation_on_the_same_observation_is_charged(self) -> None:
        taken = Reservation(peer_id="cw", backend_id="b", observation_epoch_ms=EPOCH, amounts={"h100": 8})
        assert where(tick([job("j")], HOME_CPU, peer("cw", h100("b", 8)), reservations=[taken])) == {}

    def test_a_newer_observation_frees_the_ledger(self) -> None:
        old = Reservation(peer_id="cw", backend_id="b", observation_epoch_ms=EPOCH - 1, amounts={"h100": 8})
        assert where(tick([job("j")], HOME_CPU, peer("cw", h100("b", 8)), reservations=[old])) == {
            "j": ("cw", "b")
        }

    def test_placement_reservation_replays_in_the_next_tick(self) -> None:
        report = peer("cw", h100("b", 12))
        first = tick([job("a")], HOME_CPU, report)
        ledger = [r for p in first.placements if (r := p.reservation()) is not None]
        assert ledger == [
            Reservation(
                peer_id="cw",
                backend_id="b",
                observation_epoch_ms=EPOCH,
                amounts={"h100": 8},
                band=Band.INTERACTIVE,
                job_id="a",
            )
        ]
        assert where(tick([job("b")], HOME_CPU, report, reservations=ledger)) == {}


class TestReachability:
    def test_unreachable_and_stale_peers_host_nothing(self) -> None:
        down = peer("down", h100("b", 64), reachable=False)
        stale = peer("stale", h100("b", 64), last_contact_ms=NOW - STALE - 1)
        result = tick([job("j")], HOME_CPU, down, stale)
        assert result.placements == []
        explanation = result.explain("j")
        assert explanation is not None
        kinds = {v.kind: v.peer_ids for v in explanation.verdicts}
        assert kinds[WaitKind.UNREACHABLE] == ["down"]
        assert kinds[WaitKind.STALE] == ["stale"]

    def test_stale_home_hosts_nothing(self) -> None:
        home = peer("marin", h100("h", 64), last_contact_ms=None)
        assert where(tick([job("j")], home)) == {}


class TestPins:
    def test_pinned_job_only_goes_to_its_peer(self) -> None:
        result = tick(
            [job("j", pin="cw-b")],
            peer("marin", h100("h", 64)),
            peer("cw-a", h100("b", 8)),
            peer("cw-b", h100("b", 64)),
        )
        assert where(result) == {"j": ("cw-b", "b")}

    def test_pinned_job_waits_when_its_peer_has_a_full_backend_of_its_shape(self) -> None:
        result = tick([job("j", pin="cw")], peer("marin", h100("h", 64)), peer("cw", h100("b", 4)))
        assert where(result) == {}
        explanation = result.explain("j")
        assert explanation is not None
        assert explanation.summary.startswith("Queued for peer cw to report free capacity")
        assert [v.peer_ids for v in explanation.verdicts] == [["cw"]]

    def test_pinned_job_is_force_routed_when_its_peer_lacks_the_shape(self) -> None:
        result = tick([job("j", pin="cw")], HOME_CPU, peer("cw", cpu_backend("c")))
        placement = result.placements[0]
        assert (placement.peer_id, placement.backend_id, placement.forced, placement.reserved) == (
            "cw",
            "",
            True,
            {},
        )

    def test_pin_matches_the_cluster_id_case_insensitively(self) -> None:
        result = tick(
            [job("j", pin=" CW-A ")], HOME_CPU, peer("cw-a", h100("b", 8)), peer("cw-b", h100("b", 8))
        )
        assert where(result) == {"j": ("cw-a", "b")}

    def test_pinned_job_waits_for_an_unreachable_peer(self) -> None:
        result = tick([job("j", pin="cw")], HOME_CPU, peer("cw", reachable=False))
        assert where(result) == {}

    def test_pin_to_an_unknown_cluster_waits_with_a_reason(self) -> None:
        result = tick([job("j", pin="ghost")], HOME_CPU)
        explanation = result.explain("j")
        assert explanation is not None
        assert explanation.verdicts[0].kind is WaitKind.UNKNOWN_PEER


class TestCapAndExpiry:
    def test_per_peer_cap_applies_with_capacity_left(self) -> None:
        jobs = [job(f"j{i}", count=1, submit_ms=i) for i in range(3)]
        result = tick(jobs, HOME_CPU, peer("cw", h100("b", 64)), cap=2)
        assert sorted(where(result)) == ["j0", "j1"]
        explanation = result.explain("j2")
        assert explanation is not None
        verdict = explanation.for_peer("cw")
        assert verdict is not None and verdict.kind is WaitKind.PER_TICK_CAP
        assert verdict.message == "per-tick cap of 2 placements reached"

    def test_cap_overflows_to_the_next_peer(self) -> None:
        jobs = [job(f"j{i}", count=1, submit_ms=i) for i in range(2)]
        result = tick(jobs, HOME_CPU, peer("a", h100("b", 64)), peer("c", h100("b", 64)), cap=1)
        assert where(result) == {"j0": ("a", "b"), "j1": ("c", "b")}

    def test_capped_says_whether_the_cap_held_a_job_back(self) -> None:
        jobs = [job(f"j{i}", count=1, submit_ms=i) for i in range(3)]
        assert tick(jobs, HOME_CPU, peer("cw", h100("b", 64)), cap=2).capped
        assert not tick(jobs, HOME_CPU, peer("cw", h100("b", 64)), cap=3).capped
        # Waiting for capacity with no cap reached: not capped.
        full = [job("a", count=8, submit_ms=0), job("b", count=8, submit_ms=1)]
        assert not tick(full, HOME_CPU, peer("cw", h100("b", 8)), cap=2).capped

    def test_expired_jobs_are_returned_and_never_placed(self) -> None:
        jobs = [job("old", deadline_ms=NOW), job("fresh", deadline_ms=NOW + 1)]
        result = tick(jobs, HOME_CPU, peer("cw", h100("b", 64)))
        assert result.expired == ["old"]
        assert where(result) == {"fresh": ("cw", "b")}


class TestExplanations:
    def test_full_reason_names_need_band_and_best_availability(self) -> None:
        result = tick([job("j", count=16)], HOME_CPU, peer("cw", h100("a", 8), h100("b", 2)))
        explanation = result.explain("j")
        assert explanation is not None
        verdict = explanation.for_peer("cw")
        assert verdict is not None
        assert verdict.message == "full: needs 16 h100 at band interactive, 8 available"
        assert (verdict.kind, verdict.token, verdict.needed, verdict.available) == (
            WaitKind.FULL,
            "h100",
            16,
            8,
        )

    def test_no_shape_reason_names_the_missing_constraint(self) -> None:
        result = tick([job("j")], HOME_CPU, peer("cw", backend("a", gpu_attrs("a100"), free={"a100": 8})))
        explanation = result.explain("j")
        assert explanation is not None
        assert explanation.for_peer("marin") is not None
        verdict = explanation.for_peer("cw")
        assert verdict is not None and verdict.message == "no backend with device-variant=h100"

    def test_every_peer_gets_exactly_one_verdict(self) -> None:
        reports = [
            HOME_CPU,
            peer("full", h100("b", 0)),
            peer("down", reachable=False),
            peer("other", backend("a", gpu_attrs("a100"), free={"a100": 8})),
        ]
        result = tick([job("j")], *reports)
        explanation = result.explain("j")
        assert explanation is not None
        listed = sorted(p for v in explanation.verdicts for p in v.peer_ids)
        assert listed == sorted(r.peer_id for r in reports)
        assert "full on full" in explanation.summary

    def test_jobs_waiting_for_the_same_reasons_share_a_group(self) -> None:
        jobs = [job(f"j{i}", count=16, submit_ms=i) for i in range(5)]
        result = tick(jobs, HOME_CPU, peer("cw", h100("b", 8)))
        assert [g.job_ids for g in result.waiting] == [[f"j{i}" for i in range(5)]]

    def test_placed_jobs_have_no_explanation(self) -> None:
        result = tick([job("j")], HOME_CPU, peer("cw", h100("b", 8)))
        assert result.explain("j") is None
        assert "peer cw backend b" in result.placements[0].reason


class TestDeterminismAndPayloads:
    def test_same_input_same_output_whatever_the_input_order(self) -> None:
        jobs = [job(f"j{i}", count=1 + i % 8, band=Band(1 + i % 3), submit_ms=i % 4) for i in range(40)]
        reports = [HOME_CPU, peer("a", h100("x", 40)), peer("b", h100("y", 30, held={Band.BATCH: 10}))]
        first = tick(jobs, *reports)
        shuffled = list(jobs)
        random.Random(7).shuffle(shuffled)
        assert tick(shuffled, *reports) == first

    def test_duplicate_job_ids_keep_the_first_entry(self) -> None:
        result = tick([job("j", count=8), job("j", count=1)], HOME_CPU, peer("cw", h100("b", 64)))
        assert [p.reserved for p in result.placements] == [{"h100": 8}]

    def test_plan_request_and_result_round_trip_as_payloads(self) -> None:
        request = PlanRequest(
            home="marin",
            jobs=[job("a"), job("b", count=64), job("c", deadline_ms=1)],
            reports=[HOME_CPU, peer("cw", h100("b", 8))],
            now_ms=NOW,
            stale_after_ms=STALE,
            max_per_peer=4,
        )
        request = PlanRequest.model_validate_json(request.model_dump_json())
        result = plan_request(request)
        assert PlanResult.model_validate_json(result.model_dump_json()) == result
        assert (len(result.placements), result.expired, waiting_ids(result)) == (1, ["c"], ["b"])

    def test_constraints_from_the_job_are_honoured(self) -> None:
        east = peer("a-east", backend("b", gpu_attrs("h100", region="us-east"), free={"h100": 8}))
        west = peer("z-west", backend("b", gpu_attrs("h100", region="us-west"), free={"h100": 8}))
        result = tick([job("j", constraints=(eq("Region", "US-West"),))], HOME_CPU, east, west)
        assert where(result) == {"j": ("z-west", "b")}


def test_plan_restores_the_garbage_collector_state() -> None:
    import gc

    assert gc.isenabled()
    tick([job("j")], HOME_CPU)
    assert gc.isenabled()
    gc.disable()
    try:
        tick([job("j")], HOME_CPU)
        assert not gc.isenabled()
    finally:
        gc.enable()
