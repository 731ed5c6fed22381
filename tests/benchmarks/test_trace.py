"""The scheduling-quality benchmark's pure parts (benchmarks/trace.py; docs/BENCHMARKS.md,
"Scheduling quality (issue 19)"): the seeded trace generator, the offline work-conserving simulation
on the pure policy (waits computed by hand on small traces), and the figures both the simulation and
the real-stack replay are reduced to. Service-free and fast."""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections import Counter

import pytest

from benchmarks.trace import (
    ARRIVAL_SHARE,
    DEFAULT_LOAD,
    FAIR_SHARE_LOAD,
    FAIR_SHARE_USERS,
    Outcome,
    Run,
    SimResult,
    TraceConfig,
    TraceJob,
    generate,
    overrides,
    parser,
    preemption_chooser,
    preemption_figures,
    queue_wait,
    simulate,
    summarize,
    targets,
    trace_config,
    user_figures,
    users_report,
    utilization,
)
from iris.policy import Band

PEERS = (("cw-us-east-02a", 16), ("cw-rno2a", 8))
P, IA, B = Band.PRODUCTION, Band.INTERACTIVE, Band.BATCH


def job(index: int, arrival: float, band: Band, chips: int, duration: float, replicas: int = 1) -> TraceJob:
    return TraceJob(index, arrival, band, chips // replicas, replicas, duration)


def waits(result_outcomes: list[Outcome], end_s: float) -> dict[int, float]:
    return {o.index: queue_wait(o, end_s)[0] for o in result_outcomes}


# ---- the generator -----------------------------------------------------------------------------


def test_the_same_seed_gives_the_same_trace_and_another_seed_another() -> None:
    cfg = TraceConfig(peers=PEERS, window_s=20_000, seed=7)
    first, again = generate(cfg), generate(cfg)
    assert first == again and len(first) > 20
    other = generate(TraceConfig(peers=PEERS, window_s=20_000, seed=8))
    assert other != first


def test_arrivals_bands_shapes_and_load_follow_the_configured_rates() -> None:
    cfg = TraceConfig(peers=PEERS, window_s=4_000_000, seed=3, load=0.9)
    trace = generate(cfg)
    n = len(trace)
    # Poisson arrivals: the count and the mean gap match the rate (a few thousand jobs: within 5%).
    expected = cfg.rate() * cfg.window_s
    assert n > 3000
    assert abs(n - expected) / expected < 0.05
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(trace)]
    assert abs(sum(gaps) / len(gaps) * cfg.rate() - 1) < 0.05
    # An exponential gap's standard deviation equals its mean.
    mean_gap = sum(gaps) / len(gaps)
    sd = math.sqrt(sum((g - mean_gap) ** 2 for g in gaps) / len(gaps))
    assert abs(sd / mean_gap - 1) < 0.08
    assert all(0 <= j.arrival_s < cfg.window_s for j in trace)
    bands = Counter(j.band for j in trace)
    for band, share in cfg.bands:
        assert abs(bands[band] / n - share) < 0.03, band
    # Every shape fits the largest peer (8 x 3 = 24 > 16 is drawn again), each at its share.
    assert max(j.chips for j in trace) <= 16
    shapes = Counter((j.gpus, j.replicas) for j in trace)
    assert (8, 3) not in shapes
    for g, r, p in cfg.shapes():
        assert abs(shapes[(g, r)] / n - p) < 0.03, (g, r)
    assert {g for g, _ in shapes} == {1, 2, 4, 8} and {r for _, r in shapes} == {1, 2, 3}
    ranges = {b: (lo, hi) for b, lo, hi in cfg.durations}
    assert all(ranges[j.band][0] <= j.duration_s <= ranges[j.band][1] for j in trace)
    # Offered load: chip-seconds asked per second, as a share of the peers' chips.
    offered = sum(j.chips * j.duration_s for j in trace) / (cfg.capacity * cfg.window_s)
    assert abs(offered - 0.9) < 0.05


def test_the_rate_scales_with_the_load_and_the_peers() -> None:
    base = TraceConfig(peers=PEERS, window_s=100)
    assert TraceConfig(peers=PEERS, window_s=100, load=1.8).rate() == pytest.approx(2 * base.rate())
    bigger = TraceConfig(peers=(("a", 24), ("b", 24)), window_s=100)
    # Two 24-chip peers: twice the chips, and the 8 x 3 shape now fits (a larger mean shape).
    assert (8, 3) in {(g, r) for g, r, _ in bigger.shapes()}
    assert (8, 3) not in {(g, r) for g, r, _ in base.shapes()}
    assert bigger.rate() < 2 * base.rate()
    assert sum(p for _, _, p in bigger.shapes()) == pytest.approx(1.0)
    assert sum(p for _, _, p in base.shapes()) == pytest.approx(1.0)


def test_users_are_drawn_at_their_weights_without_changing_the_seeds_jobs() -> None:
    plain = generate(TraceConfig(peers=PEERS, window_s=400_000, seed=5))
    shared = generate(TraceConfig(peers=PEERS, window_s=400_000, seed=5, users=FAIR_SHARE_USERS))
    # The same jobs (arrivals, bands, shapes, durations, limits): only who submits them is new.
    assert [dataclasses.replace(j, user="") for j in shared] == plain
    assert {j.user for j in plain} == {""}
    users = Counter(j.user for j in shared)
    assert set(users) == {"a", "b"} and len(shared) > 300
    assert abs(users["a"] / users["b"] - 5) < 1.2
    with pytest.raises(ValueError, match="distinct names and positive weights"):
        TraceConfig(peers=PEERS, window_s=10, users=(("a", 1.0), ("a", 2.0)))
    with pytest.raises(ValueError, match="distinct names and positive weights"):
        TraceConfig(peers=PEERS, window_s=10, users=(("a", 0.0),))


def test_the_fair_share_scenario_is_batch_only_at_its_own_load_unless_told() -> None:
    args = parser().parse_args(["--fair-share"])
    assert args.fair_share and args.load is None
    assert FAIR_SHARE_LOAD > 1 and dict(FAIR_SHARE_USERS) == {"a": 5.0, "b": 1.0}
    cfg = trace_config(args, PEERS)
    assert cfg.bands == ((B, 1.0),) and cfg.users == FAIR_SHARE_USERS and cfg.load == FAIR_SHARE_LOAD
    trace = generate(cfg)
    assert {j.band for j in trace} == {B} and {j.user for j in trace} == {"a", "b"}
    assert trace_config(parser().parse_args(["--fair-share", "--load", "2"]), PEERS).load == 2.0
    # Without it: the three bands, one user, the default load; the window is in trace seconds.
    plain = trace_config(parser().parse_args(["--minutes", "2", "--scale", "10"]), PEERS)
    assert plain.users == () and len(plain.bands) == 3 and plain.load == DEFAULT_LOAD
    assert plain.window_s == 2 * 60 * ARRIVAL_SHARE * 10


def test_the_exemption_and_the_horizon_can_be_set_for_the_stack_and_the_bound() -> None:
    from iris.config import load_config

    cfg = load_config()
    overrides(cfg, parser().parse_args([]))
    assert cfg == load_config()  # nothing given: the config's own
    overrides(cfg, parser().parse_args(["--preempt-exempt-s", "0", "--aging-horizon-s", "30"]))
    assert {c.preempt_exempt_s for c in cfg.clusters} == {0.0} and cfg.aging_horizon_s == 30.0


def test_a_trace_config_that_cannot_work_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one peer"):
        TraceConfig(peers=(), window_s=10)
    with pytest.raises(ValueError, match="positive"):
        TraceConfig(peers=PEERS, window_s=0)
    with pytest.raises(ValueError, match="no shape fits"):
        TraceConfig(peers=(("tiny", 1),), window_s=10, gpus=((2, 1.0),))


def test_bad_command_line_values_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["--minutes", "0"],
        ["--minutes", "nan"],
        ["--scale", "-1"],
        ["--load", "x"],
        ["--preempt-exempt-s", "-1"],
        ["--aging-horizon-s", "inf"],
    ):
        with pytest.raises(SystemExit) as exc:
            parser().parse_args(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("benchmarks.trace: error: argument --"), (argv, err)


# ---- the offline simulation --------------------------------------------------------------------


def test_without_preemption_a_higher_band_waits_for_the_end_of_batch_work() -> None:
    # One 8-chip peer full of a batch job until t=10; a production 4 at t=1, a batch 4 at t=2: both
    # start at 10 (4 + 4 fit), waiting 9 and 8.
    trace = [job(0, 0, B, 8, 10), job(1, 1, P, 4, 5), job(2, 2, B, 4, 3)]
    r = simulate(trace, {"p": 8})
    assert waits(r.outcomes, r.end_s) == {0: 0, 1: 9, 2: 8}
    assert r.end_s == 15 and not r.rejected
    assert preemption_figures(r.outcomes) == {"preemptions": 0, "wasted_gpu_s": 0.0}


def test_the_queue_runs_in_band_order_and_a_smaller_job_backfills() -> None:
    # A 4-chip peer: batch A runs 0-10; batch B (t=1) and production C (t=2) both need the whole
    # peer: C goes first at 10 (band before submit time), B at 15.
    trace = [job(0, 0, B, 4, 10), job(1, 1, B, 4, 3), job(2, 2, P, 4, 5)]
    r = simulate(trace, {"p": 4})
    assert waits(r.outcomes, r.end_s) == {0: 0, 1: 14, 2: 8}
    # An 8-chip peer with 6 taken until 10: an interactive 4 waits, a batch 2 after it starts at once.
    trace = [job(0, 0, B, 6, 10), job(1, 1, IA, 4, 5), job(2, 2, B, 2, 3)]
    r = simulate(trace, {"p": 8})
    assert waits(r.outcomes, r.end_s) == {0: 0, 1: 9, 2: 0}


def test_jobs_take_the_tightest_peer_and_time_is_compressed_by_the_scale() -> None:
    # An 8-chip job takes the 8-chip peer, leaving the 16-chip one to the 16-chip job: neither waits.
    trace = [job(0, 0, IA, 8, 60), job(1, 0, IA, 16, 120, replicas=2)]
    r = simulate(trace, {"big": 16, "small": 8}, scale=60)
    by = {o.index: o for o in r.outcomes}
    assert by[0].runs[0].peer == "small" and by[1].runs[0].peer == "big"
    assert waits(r.outcomes, r.end_s) == {0: 0, 1: 0}
    assert by[0].runs[0].end_s == 1 and by[1].runs[0].end_s == 2  # 60 and 120 trace s / 60
    # Compressed: a wait of 600 trace seconds is 10 replay seconds.
    r = simulate([job(0, 0, B, 8, 600), job(1, 60, B, 8, 60)], {"p": 8}, scale=60)
    assert waits(r.outcomes, r.end_s) == {0: 0, 1: 9}


def test_with_preemption_an_interactive_job_stops_the_youngest_batch_job_which_comes_back() -> None:
    model = preemption_chooser()
    chooser, how = model.chooser, model.how
    assert chooser is not None, how  # iris/policy/preemption.py is in this revision
    # An 8-chip peer: batch A (0-10) and batch B (from 1) fill it; interactive C (t=2, 5 s) stops B,
    # the youngest, runs 2-7; B restarts at 7: its wait is 0 + (7 - 2) = 5, its lost run 4 chips x 1 s.
    trace = [job(0, 0, B, 4, 10), job(1, 1, B, 4, 10), job(2, 2, IA, 4, 5)]
    r = simulate(trace, {"p": 8}, chooser=chooser, preemption=how)
    by = {o.index: o for o in r.outcomes}
    assert [(x.start_s, x.end_s, x.preempted) for x in by[1].runs] == [(1, 2, True), (7, 17, False)]
    assert waits(r.outcomes, r.end_s) == {0: 0, 1: 5, 2: 0}
    assert preemption_figures(r.outcomes) == {"preemptions": 1, "wasted_gpu_s": 4.0}
    # The same trace without preemption: C waits for A's end at 10.
    plain = simulate(trace, {"p": 8})
    assert waits(plain.outcomes, plain.end_s) == {0: 0, 1: 0, 2: 8}


def test_with_preemption_batch_preempts_nothing_and_interactive_not_its_own_band() -> None:
    model = preemption_chooser()
    chooser, how = model.chooser, model.how
    assert chooser is not None, how
    for first, late in ((B, B), (IA, IA), (P, IA)):
        trace = [job(0, 0, first, 8, 10), job(1, 1, late, 8, 5)]
        r = simulate(trace, {"p": 8}, chooser=chooser, preemption=how)
        assert waits(r.outcomes, r.end_s) == {0: 0, 1: 9}, (first, late)
        assert preemption_figures(r.outcomes)["preemptions"] == 0
    # Production preempts interactive.
    r = simulate([job(0, 0, IA, 8, 10), job(1, 1, P, 8, 5)], {"p": 8}, chooser=chooser, preemption=how)
    assert waits(r.outcomes, r.end_s) == {0: 5, 1: 0}


def test_with_the_exemption_a_job_back_from_a_preemption_is_not_preempted_again_too_soon() -> None:
    """preempt_exempt_s (issue 29) in the simulation: batch A (8 chips) is preempted at 1 by
    interactive C and restarts at 6, exempt until 16. Interactive D (t=7) finds A's chips exempt
    (not reclaimable), waits, and preempts A when the exemption ends (the simulation plans again
    then); with no exemption D preempts A at once."""
    model = preemption_chooser(10)
    assert model.chooser is not None and model.exemption, model.how
    assert "exempt 10 s" in model.how
    trace = [job(0, 0, B, 8, 100), job(1, 1, IA, 8, 5), job(2, 7, IA, 8, 5)]
    r = simulate(trace, {"p": 8}, chooser=model.chooser, preemption=model.how, exempt_s={"p": 10})
    by = {o.index: o for o in r.outcomes}
    assert [(x.start_s, x.end_s, x.preempted) for x in by[0].runs] == [
        (0, 1, True),
        (6, pytest.approx(16), True),
        (pytest.approx(21), pytest.approx(121), False),
    ]
    assert waits(r.outcomes, r.end_s) == {0: pytest.approx(10), 1: 0, 2: pytest.approx(9)}
    # No exemption: D stops A at once, 1 s into its second run.
    r = simulate(trace, {"p": 8}, chooser=model.chooser, preemption=model.how, exempt_s={"p": 0})
    by = {o.index: o for o in r.outcomes}
    assert [(x.start_s, x.end_s, x.preempted) for x in by[0].runs] == [
        (0, 1, True),
        (6, 7, True),
        (12, 112, False),
    ]
    assert waits(r.outcomes, r.end_s) == {0: 10, 1: 0, 2: 0}


# ---- the figures -------------------------------------------------------------------------------


def test_queue_wait_adds_the_time_after_each_preemption_and_censors_a_job_still_waiting() -> None:
    o = Outcome(0, B, 4, submit_s=0.0, runs=[Run(5.0), Run(1.0, 3.0, preempted=True)])
    assert queue_wait(o, end_s=100) == (3.0, False)  # 0-1 and 3-5, whatever order the runs come in
    o = Outcome(0, B, 4, submit_s=0.0, runs=[Run(1.0, 3.0, preempted=True)])
    assert queue_wait(o, end_s=10) == (8.0, True)
    assert queue_wait(Outcome(0, B, 4, submit_s=2.0), end_s=10) == (8.0, True)
    # A run that ended (not preempted) is the last: nothing after it counts.
    o = Outcome(0, B, 4, submit_s=0.0, runs=[Run(2.0, 4.0)])
    assert queue_wait(o, end_s=50) == (2.0, False)


def test_utilization_counts_busy_chips_overall_and_while_some_job_waits() -> None:
    # Capacity 8. X (8 chips) submitted at 0, runs 2-6; Y (4) submitted at 1, runs 6-10.
    # Some job waits over 0-6 (X 0-2, Y 1-6): busy 0 then 8 -> 32 / (8 x 6). Overall 48 / 80.
    xs = [
        Outcome(0, B, 8, submit_s=0.0, runs=[Run(2.0, 6.0)]),
        Outcome(1, IA, 4, submit_s=1.0, runs=[Run(6.0, 10.0)]),
    ]
    u = utilization(xs, 8, 0.0, 10.0)
    assert u["while_waiting"] == pytest.approx(32 / 48)
    assert u["overall"] == pytest.approx(48 / 80)
    assert u["waiting_s"] == pytest.approx(6.0) and u["span_s"] == pytest.approx(10.0)
    # A preempted run frees its chips and its job waits again until its next run.
    ys = [Outcome(0, B, 8, submit_s=0.0, runs=[Run(0.0, 2.0, preempted=True), Run(4.0, None)])]
    u = utilization(ys, 8, 0.0, 8.0)
    assert u["waiting_s"] == pytest.approx(2.0) and u["while_waiting"] == pytest.approx(0.0)
    assert u["overall"] == pytest.approx((2 + 4) / 8)
    # Nobody waits: no figure.
    assert math.isnan(utilization([Outcome(0, B, 8, 0.0, [Run(0.0, 1.0)])], 8, 0, 1)["while_waiting"])


def test_summary_gives_percentiles_in_seconds_and_ticks_and_counts_the_starved() -> None:
    # Ten batch jobs waiting 1 s, one 15 s, one 30 s: median 1 s, under one tick of 2 s, which
    # counts instead, so the bar is 10 x 2 s = 20 s: the 30 s one starved, the 15 s one did not.
    xs = [Outcome(i, B, 1, submit_s=0.0, runs=[Run(1.0, 2.0)]) for i in range(10)]
    xs.append(Outcome(10, B, 1, submit_s=0.0, runs=[Run(30.0, 31.0)]))
    xs.append(Outcome(11, B, 1, submit_s=0.0, runs=[Run(15.0, 16.0)]))
    xs.append(Outcome(12, P, 1, submit_s=0.0, runs=[Run(0.0, 1.0)]))
    s = summarize(xs, end_s=40, tick_s=2.0)
    assert s["batch"]["p50_s"] == 1.0 and s["batch"]["p50_ticks"] == 0.5
    assert s["batch"]["starved"] == 1 and s["batch"]["starved_jobs"] == [10]
    assert s["batch"]["jobs"] == 12 and s["batch"]["started"] == 12 and s["batch"]["censored"] == 0
    assert s["production"]["p95_s"] == 0.0 and s["production"]["starved"] == 0
    assert s["interactive"]["jobs"] == 0 and math.isnan(s["interactive"]["p50_s"])
    assert s["all"]["jobs"] == 13 and s["all"]["starved"] == 1


def test_the_targets_line_says_which_of_issue_19s_targets_are_met() -> None:
    # Capacity 8, ticks of 2 s: production (8 chips) waits 4 s (2 ticks) while a batch job holds 4
    # of the 8 chips: utilization while waiting 50%; no one starved.
    xs = [
        Outcome(0, B, 4, submit_s=0.0, runs=[Run(0.0, 4.0)]),
        Outcome(1, P, 8, submit_s=0.0, runs=[Run(4.0, 5.0)]),
    ]
    line = targets({"bands": summarize(xs, 5.0, 2.0), "utilization": utilization(xs, 8, 0.0, 5.0)})
    assert "production p95 ≤ 2 ticks met (2.0)" in line
    assert "utilization while waiting ≥ 90% NOT met (50%)" in line
    assert "no starvation met (0 starved, 0 still waiting)" in line
    # Production waiting 5 ticks, and a job still waiting at the end.
    xs[1].runs = [Run(10.0, 11.0)]
    xs.append(Outcome(2, B, 8, submit_s=1.0))
    line = targets({"bands": summarize(xs, 12.0, 2.0), "utilization": utilization(xs, 8, 0.0, 12.0)})
    assert "production p95 ≤ 2 ticks NOT met (5.0)" in line
    assert "no starvation NOT met (0 starved, 1 still waiting)" in line


# ---- fair share between users -----------------------------------------------------------------


def test_user_figures_count_what_each_user_held_while_every_user_had_a_job_waiting() -> None:
    # a: 4 chips 0-10, then a job waiting 2-10 (runs 10-12); b: a job waiting 5-8, then 2 chips 8-12.
    # Both wait in [5, 8]: a holds 4 chips, b none; then b's job starts: 3 s x 4 = 12 GPU-s for a.
    outcomes = [
        Outcome(0, B, 4, 0.0, [Run(0, 10)], user="a"),
        Outcome(1, B, 4, 2.0, [Run(10, 12)], user="a"),
        Outcome(2, B, 2, 5.0, [Run(8, 12)], user="b"),
        Outcome(3, IA, 8, 0.0, [Run(0, 12)], user="b"),  # another band: not counted for batch
    ]
    fig = user_figures(outcomes, 12.0, B)
    assert fig["contended_s"] == 3.0
    a, b = fig["users"]["a"], fig["users"]["b"]
    assert a["contended_gpu_s"] == 12.0 and b["contended_gpu_s"] == 0.0
    assert a["contended_share"] == 1.0 and b["contended_share"] == 0.0
    assert a["gpu_s"] == 48.0 and b["gpu_s"] == 8.0
    assert (a["jobs"], a["p50_s"], b["p95_s"]) == (2, 4.0, 3.0)
    # Every band: b's interactive job counts, and its batch job waits as before.
    every = user_figures(outcomes, 12.0)
    assert every["users"]["b"]["gpu_s"] == 8.0 + 96.0 and every["contended_s"] == 3.0
    # One user alone is never "contended".
    assert user_figures(outcomes[:2], 12.0, B)["contended_s"] == 0.0
    # A preempted run: lost GPU-seconds per user, and its wait after the preemption is counted.
    bumped = [Outcome(0, B, 2, 0.0, [Run(0, 4, preempted=True), Run(6, 9)], user="a")]
    mine = user_figures(bumped, 9.0)["users"]["a"]
    assert (mine["preemptions"], mine["wasted_gpu_s"], mine["p50_s"]) == (1, 8.0, 2.0)


def fair_share_trace(n_a: int, n_b: int) -> list[TraceJob]:
    """a's ``n_a`` 4-chip batch jobs arrive first, then b's ``n_b``: on one 8-chip peer."""
    jobs = [TraceJob(i, 0.1 * i, B, 4, 1, 10.0, user="a") for i in range(n_a)]
    jobs += [TraceJob(n_a + i, 0.1 * (n_a + i), B, 4, 1, 10.0, user="b") for i in range(n_b)]
    return jobs


def test_with_fair_share_the_light_users_job_goes_ahead_of_the_heavy_users_backlog() -> None:
    trace = fair_share_trace(6, 2)

    def starts(r: SimResult, user: str) -> list[float]:
        return sorted(o.runs[0].start_s for o in r.outcomes if o.user == user)

    # FIFO within the band (horizon 0): b's jobs run last, after a's whole backlog.
    fifo = simulate(trace, {"p": 8}, aging_horizon_s=0.0)
    assert min(starts(fifo, "b")) >= 30 > max(starts(fifo, "a"))
    # Fair share: when a's first job ends (t = 10), a holds half the peer and b nothing: b's first
    # job takes the room, ahead of a's four waiting. At 10.1 a holds nothing and b half: a's next
    # goes; at 20 b's first ends and b's second goes ahead of a's three still waiting.
    fair = simulate(trace, {"p": 8}, aging_horizon_s=3600.0)
    b_starts, a_starts = starts(fair, "b"), starts(fair, "a")
    assert b_starts == [pytest.approx(10.0), pytest.approx(20.0)]
    assert sum(1 for t in a_starts if t < b_starts[1]) == 3
    fair_b = user_figures(fair.outcomes, fair.end_s, B)["users"]["b"]["contended_share"]
    fifo_b = user_figures(fifo.outcomes, fifo.end_s, B)["users"]["b"]["contended_share"]
    assert fifo_b == 0.0 < fair_b


def test_the_users_report_gives_the_lightest_users_share_and_the_verdict() -> None:
    trace = fair_share_trace(6, 2)
    fair = simulate(trace, {"p": 8}, aging_horizon_s=3600.0)
    fifo = simulate(trace, {"p": 8}, aging_horizon_s=0.0)
    bound = {
        "users": {
            "all": user_figures(fair.outcomes, fair.end_s),
            B.label: user_figures(fair.outcomes, fair.end_s, B),
        }
    }
    plain = {
        "users": {
            "all": user_figures(fifo.outcomes, fifo.end_s),
            B.label: user_figures(fifo.outcomes, fifo.end_s, B),
        }
    }
    text = users_report(None, bound, plain)
    assert "per user (bound):" in text
    assert re.search(r"^a\s+6\s+6\s", text, re.MULTILINE) and re.search(r"^b\s+2\s+2\s", text, re.MULTILINE)
    share = bound["users"][B.label]["users"]["b"]["contended_share"]
    assert f"fair share (batch): b, with the fewest jobs, held {round(100 * share)}%" in text
    assert "bound with FIFO within the band 0%" in text
    assert ("target of issue 29: the lightest user holds ≥ 40%: met" in text) == (share >= 0.4)
    # Measured beside the bound: both shares on one line.
    text = users_report(plain, bound, plain)
    assert "per user (measured):" in text and "NOT met" in text and "; bound " in text
