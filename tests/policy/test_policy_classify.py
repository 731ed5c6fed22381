"""Submit-time classification (docs/DESIGN.md, "Classification") and pick_backend."""

from __future__ import annotations

from policy_factories import EPOCH, NOW, STALE, backend, cpu_backend, cpu_job, eq, gpu_attrs, h100, job, peer

from iris.policy import (
    Band,
    Classification,
    Disposition,
    JobShape,
    PeerReport,
    Reservation,
    classify,
    pick_backend,
)


def run(shape: JobShape, *reports: PeerReport, reservations: tuple[Reservation, ...] = ()) -> Classification:
    return classify(
        shape,
        home="marin",
        reports=list(reports),
        now_ms=NOW,
        stale_after_ms=STALE,
        reservations=reservations,
    )


HOME_CPU = peer("marin", cpu_backend("cpu-a"))
HOME_H100 = peer("marin", cpu_backend("cpu-a"), h100("h100-home", 16))
HOME_H100_FULL = peer("marin", cpu_backend("cpu-a"), h100("h100-home", 0))
CW = peer("cw-us-east-02a", h100("h100-east", 16))


class TestPin:
    def test_pin_queues_even_when_local_could_run_it(self) -> None:
        result = run(job(pin="cw-us-east-02a"), HOME_H100, CW)
        assert result.disposition is Disposition.QUEUE
        assert result.pinned_cluster == "cw-us-east-02a"
        assert result.reason == "Queued for peer cw-us-east-02a to report free capacity"

    def test_pin_to_home_runs_local(self) -> None:
        result = run(job(pin="marin"), HOME_H100_FULL, CW)
        assert (result.disposition, result.pinned_cluster) == (Disposition.LOCAL, "marin")

    def test_pin_to_unknown_cluster_is_rejected_with_known_list(self) -> None:
        result = run(job(pin="nowhere"), HOME_H100, CW, peer("cw-rno2a"))
        assert result.disposition is Disposition.REJECT
        assert result.reason == "unknown cluster 'nowhere' (known: cw-rno2a, cw-us-east-02a, marin)"

    def test_pin_queues_whatever_the_peer_advertises(self) -> None:
        result = run(job(variant="b200", pin="cw-us-east-02a"), HOME_CPU, CW)
        assert (result.disposition, result.pinned_cluster) == (Disposition.QUEUE, "cw-us-east-02a")

    def test_pin_to_unreachable_peer_still_queues_and_says_so(self) -> None:
        down = peer("cw-us-east-02a", reachable=False)
        result = run(job(pin="cw-us-east-02a"), HOME_CPU, down)
        assert result.disposition is Disposition.QUEUE
        assert "currently unreachable" in result.reason

    def test_pin_is_case_insensitive(self) -> None:
        assert run(job(pin="CW-US-EAST-02A"), HOME_CPU, CW).pinned_cluster == "cw-us-east-02a"


class TestPreferLocal:
    def test_prefer_local_with_a_reachable_peer(self) -> None:
        result = run(job(), HOME_H100, CW)
        assert result.disposition is Disposition.LOCAL
        assert result.pinned_cluster is None
        assert "h100-home" in result.reason

    def test_cpu_job_runs_at_home(self) -> None:
        assert run(cpu_job(), HOME_CPU, CW).disposition is Disposition.LOCAL

    def test_home_full_queues_unpinned_with_home_as_candidate(self) -> None:
        result = run(job(count=16), peer("marin", h100("h100-home", 8)), CW)
        assert result.disposition is Disposition.QUEUE
        assert result.pinned_cluster is None
        assert result.reason.startswith("Queued for a federation peer to report free capacity")
        assert "8 of the 16 h100" in result.reason

    def test_home_full_and_no_peer_still_queues_for_home(self) -> None:
        result = run(job(), HOME_H100_FULL, peer("cw-us-east-02a", reachable=False))
        assert result.disposition is Disposition.QUEUE

    def test_gate_counts_replicas(self) -> None:
        # 3 replicas x 8 H100 needs 24 on one backend.
        assert run(job(replicas=3), peer("marin", h100("a", 23)), CW).disposition is Disposition.QUEUE
        assert run(job(replicas=3), peer("marin", h100("a", 24)), CW).disposition is Disposition.LOCAL

    def test_capacity_is_not_summed_across_home_backends(self) -> None:
        home = peer("marin", h100("a", 8), h100("b", 8))
        assert run(job(count=16), home, CW).disposition is Disposition.QUEUE

    def test_reclaimable_capacity_is_not_free_now(self) -> None:
        home = peer("marin", h100("a", 0, held={Band.BATCH: 16}))
        assert run(job(), home, CW).disposition is Disposition.QUEUE

    def test_legacy_home_backend_has_no_gate(self) -> None:
        home = peer("marin", backend("legacy", gpu_attrs("h100")))
        assert run(job(), home, CW).disposition is Disposition.LOCAL

    def test_unknown_block_version_is_shape_only(self) -> None:
        home = peer("marin", backend("v9", gpu_attrs("h100"), free={}, version=9))
        assert run(job(), home, CW).disposition is Disposition.LOCAL

    def test_empty_amounts_means_nothing_free(self) -> None:
        home = peer("marin", backend("empty", gpu_attrs("h100"), free={}))
        assert run(job(), home, CW).disposition is Disposition.QUEUE

    def test_reservations_on_the_same_observation_count(self) -> None:
        home = peer("marin", h100("a", 8))
        taken = Reservation(peer_id="marin", backend_id="a", observation_epoch_ms=EPOCH, amounts={"h100": 8})
        old = taken.model_copy(update={"observation_epoch_ms": EPOCH - 1})
        assert run(job(), home, CW, reservations=(taken,)).disposition is Disposition.QUEUE
        assert run(job(), home, CW, reservations=(old,)).disposition is Disposition.LOCAL

    def test_stale_home_queues(self) -> None:
        home = peer("marin", h100("a", 16), last_contact_ms=NOW - STALE - 1)
        result = run(job(), home, CW)
        assert result.disposition is Disposition.QUEUE
        assert "home cluster marin is stale" in result.reason

    def test_unreachable_home_queues(self) -> None:
        home = peer("marin", h100("a", 16), reachable=False)
        assert run(job(), home, CW).disposition is Disposition.QUEUE

    def test_tpu_is_not_gated(self) -> None:
        attrs = {"device-type": ["tpu"], "device-variant": ["tpu-v5p"]}
        home = peer("marin", backend("tpu", attrs, free={}))
        assert run(job(variant="tpu-v5p", device_type="tpu", count=0), home).disposition is Disposition.LOCAL


class TestQueueAndReject:
    def test_no_home_match_queues_for_a_peer(self) -> None:
        result = run(job(), HOME_CPU, CW)
        assert (result.disposition, result.reason) == (
            Disposition.QUEUE,
            "Queued for a federation peer to report free capacity",
        )

    def test_full_peer_still_queues(self) -> None:
        assert run(job(), HOME_CPU, peer("cw", h100("x", 0))).disposition is Disposition.QUEUE

    def test_reject_names_the_missing_constraint(self) -> None:
        result = run(job(variant="tpu-v5p", device_type="tpu", count=0), HOME_CPU, CW)
        assert result.disposition is Disposition.REJECT
        assert result.reason == "no backend in the federation satisfies device-type=tpu"

    def test_queue_when_the_only_matching_peer_is_unreachable(self) -> None:
        # Its backend still exists (docs/DESIGN.md, "Classification": it rejects only a shape no
        # backend anywhere has): the job waits for it instead of being rejected while its controller
        # restarts.
        down = peer("cw-us-east-02a", h100("h100-east", 16), reachable=False)
        result = run(job(), HOME_CPU, down)
        assert result.disposition is Disposition.QUEUE
        assert result.reason == (
            "Queued for a federation peer to report free capacity"
            " (only cw-us-east-02a unreachable can run it)"
        )

    def test_queue_when_the_only_matching_peer_is_stale(self) -> None:
        stale = peer("cw-us-east-02a", h100("h100-east", 16), last_contact_ms=NOW - STALE - 1)
        result = run(job(), HOME_CPU, stale)
        assert result.disposition is Disposition.QUEUE
        assert "only cw-us-east-02a stale can run it" in result.reason

    def test_an_unreachable_peer_reports_no_backends_its_configured_ones_count(self) -> None:
        down = peer("cw-us-east-02a", reachable=False)  # what a failed poll yields: no backends
        assert run(job(), HOME_CPU, down).disposition is Disposition.REJECT
        configured = {"cw-us-east-02a": [h100("h100-east", 0)], "cw-other": [h100("x", 8)]}
        result = classify(
            job(),
            home="marin",
            reports=[HOME_CPU, down],
            now_ms=NOW,
            stale_after_ms=STALE,
            configured=configured,
        )
        assert result.disposition is Disposition.QUEUE
        assert "only cw-us-east-02a unreachable can run it" in result.reason

    def test_configured_backends_never_replace_a_live_report(self) -> None:
        # A reachable peer's own report is the truth about its shapes, whatever the config says.
        configured = {"cw-us-east-02a": [h100("h100-east", 16)]}
        live_cpu_only = peer("cw-us-east-02a", cpu_backend("c"))
        result = classify(
            job(), home="marin", reports=[HOME_CPU, live_cpu_only], now_ms=NOW, stale_after_ms=STALE,
            configured=configured,
        )  # fmt: skip
        assert result.disposition is Disposition.REJECT

    def test_reject_when_an_unreachable_peer_has_no_such_shape_either(self) -> None:
        down = peer("cw-us-east-02a", h100("h100-east", 16), reachable=False)
        result = run(job(variant="tpu-v5p", device_type="tpu", count=0), HOME_CPU, down)
        assert result.disposition is Disposition.REJECT
        assert result.reason == (
            "no backend in the federation satisfies device-type=tpu"
            " (not considered: cw-us-east-02a unreachable)"
        )

    def test_reject_names_combination_when_each_constraint_exists_somewhere(self) -> None:
        east = peer("cw-east", backend("h", gpu_attrs("h100", region="us-east"), free={"h100": 8}))
        west = peer("cw-west", backend("a", gpu_attrs("a100", region="us-west"), free={"a100": 8}))
        result = run(job(constraints=(eq("region", "us-west"),)), HOME_CPU, east, west)
        assert result.disposition is Disposition.REJECT
        assert result.reason == (
            "no single backend in the federation satisfies all of"
            " device-type=gpu, device-variant=h100, region=us-west"
        )

    def test_cpu_job_with_no_backend_anywhere_is_rejected(self) -> None:
        result = run(cpu_job(), peer("marin"), peer("cw"))
        assert result.disposition is Disposition.REJECT

    def test_home_backend_counts_even_when_home_is_unreachable(self) -> None:
        home = peer("marin", h100("a", 16), reachable=False)
        assert run(job(), home).disposition is Disposition.QUEUE


class TestPickBackend:
    def test_prefers_idle_fit_then_tightest(self) -> None:
        report = peer("cw", h100("big", 64), h100("tight", 8), h100("small", 4))
        assert pick_backend(job(), report) == "tight"

    def test_prefers_idle_over_preempting(self) -> None:
        report = peer("cw", h100("preempt", 0, held={Band.BATCH: 8}), h100("idle", 16))
        assert pick_backend(job(), report) == "idle"

    def test_preempting_beats_shape_only(self) -> None:
        report = peer("cw", backend("legacy", gpu_attrs("h100")), h100("preempt", 0, held={Band.BATCH: 8}))
        assert pick_backend(job(), report) == "preempt"

    def test_returns_a_full_backend_when_nothing_fits(self) -> None:
        report = peer("cw", h100("b", 2), h100("a", 4))
        assert pick_backend(job(), report) == "a"

    def test_no_matching_shape(self) -> None:
        assert pick_backend(job(variant="a100"), peer("cw", h100("b", 16))) is None

    def test_ties_break_on_backend_id(self) -> None:
        assert pick_backend(cpu_job(), peer("marin", cpu_backend("z"), cpu_backend("b"))) == "b"
