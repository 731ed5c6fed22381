"""Property tests of the victim choice (docs/DESIGN.md, "Preemption"): among the allowed
victims that make the job fit, the lowest bands, then the fewest exempt ones (``production`` only),
then the least work lost, then the fewest, then by id; never an equal or higher band; ``batch``
preempts nothing; a job back from a preemption is never chosen again within ``preempt_exempt_s``
of its restart by an ``interactive`` job (issue 29, acceptance 3), and by a ``production`` one only
when nothing else of its band could make room."""

from __future__ import annotations

import itertools
import random
import time

from budget import scaled
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iris.policy import Band
from iris.policy.preemption import RunningTask, choose_victims, deficit, is_exempt, may_preempt, work_lost

SETTINGS = settings(max_examples=scaled(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOKENS = ("h100", "a100", "cpu")


@st.composite
def running_tasks(draw: st.DrawFn, max_size: int = 7) -> list[RunningTask]:
    n = draw(st.integers(0, max_size))
    tasks = []
    for i in range(n):
        token = draw(st.sampled_from(TOKENS))
        amounts = {token: draw(st.integers(1, 8))}
        if draw(st.integers(0, 4)) == 0:  # now and then a task holding two tokens
            amounts[draw(st.sampled_from(TOKENS))] = draw(st.integers(1, 4))
        tasks.append(
            RunningTask(
                task_id=f"job-{i}",
                band=draw(st.sampled_from(list(Band))),
                amounts=amounts,
                # Ties in start time (and so in work lost) happen; a start after "now" too.
                started_ms=draw(st.integers(0, 12)),
                preempted_before=draw(st.integers(0, 2)),
            )
        )
    return tasks


needs = st.dictionaries(st.sampled_from(TOKENS), st.integers(1, 16), min_size=1, max_size=2)
frees = st.dictionaries(st.sampled_from(TOKENS), st.integers(0, 8), max_size=3)
nows = st.integers(0, 14)
exempts = st.integers(0, 10)


def _fits(need: dict[str, int], free: dict[str, int], victims: list[RunningTask]) -> bool:
    return all(free.get(t, 0) + sum(v.amounts.get(t, 0) for v in victims) >= n for t, n in need.items())


def _work(task: RunningTask, now_ms: int) -> int:
    return sum(task.amounts.values()) * max(0, now_ms - task.started_ms)


def _exempt(task: RunningTask, now_ms: int, exempt_ms: int) -> bool:
    return exempt_ms > 0 and task.preempted_before > 0 and now_ms - task.started_ms < exempt_ms


def _key(
    combo: tuple[RunningTask, ...], now_ms: int, exempt_ms: int = 0
) -> tuple[int, int, int, int, int, tuple[str, ...]]:
    """The order, written out: the fewest production then interactive victims (batch ones are
    weighed by the rest only), the fewest exempt victims, the least work lost, the fewest victims,
    the smallest sorted ids."""
    return (
        sum(1 for t in combo if t.band is Band.PRODUCTION),
        sum(1 for t in combo if t.band is Band.INTERACTIVE),
        sum(1 for t in combo if _exempt(t, now_ms, exempt_ms)),
        sum(_work(t, now_ms) for t in combo),
        len(combo),
        tuple(sorted(t.task_id for t in combo)),
    )


def _best(
    band: Band,
    need: dict[str, int],
    free: dict[str, int],
    running: list[RunningTask],
    now_ms: int,
    exempt_ms: int,
) -> set[str] | None:
    """The reference: the best of every subset of the allowed tasks that fits (exempt ones only
    for a production job, the most protected band)."""
    allowed = [
        t
        for t in running
        if int(t.band) > int(band) and (band is Band.PRODUCTION or not _exempt(t, now_ms, exempt_ms))
    ]
    best: tuple[int, int, int, int, int, tuple[str, ...]] | None = None
    chosen: set[str] | None = None
    for k in range(len(allowed) + 1):
        for combo in itertools.combinations(allowed, k):
            if not _fits(need, free, list(combo)):
                continue
            key = _key(combo, now_ms, exempt_ms)
            if best is None or key < best:
                best, chosen = key, {t.task_id for t in combo}
    return chosen


@SETTINGS
@given(
    band=st.sampled_from(list(Band)),
    need=needs,
    free=frees,
    running=running_tasks(),
    now=nows,
    exempt=exempts,
)
def test_victims_are_the_best_allowed_set(
    band: Band,
    need: dict[str, int],
    free: dict[str, int],
    running: list[RunningTask],
    now: int,
    exempt: int,
) -> None:
    victims = choose_victims(band, need, free, running, now_ms=now, exempt_ms=exempt)
    expected = _best(band, need, free, running, now, exempt)
    if expected is None:
        assert victims is None  # no allowed set makes the job fit
        return
    assert victims is not None
    ids = [v.task_id for v in victims]
    assert len(ids) == len(set(ids))
    # Never an equal or higher band, never an exempt task but for production; the release makes
    # the job fit.
    assert all(int(v.band) > int(band) for v in victims)
    if band is not Band.PRODUCTION:
        assert not any(is_exempt(v, now_ms=now, exempt_ms=exempt) for v in victims)
    assert _fits(need, free, victims)
    assert set(ids) == expected


@SETTINGS
@given(need=needs, free=frees, running=running_tasks(), now=nows)
def test_batch_preempts_nothing(
    need: dict[str, int], free: dict[str, int], running: list[RunningTask], now: int
) -> None:
    victims = choose_victims(Band.BATCH, need, free, running, now_ms=now)
    assert victims == ([] if not deficit(need, free) else None)


@SETTINGS
@given(need=needs, free=frees, running=running_tasks(), now=nows)
def test_interactive_never_preempts_interactive_or_production(
    need: dict[str, int], free: dict[str, int], running: list[RunningTask], now: int
) -> None:
    victims = choose_victims(Band.INTERACTIVE, need, free, running, now_ms=now)
    assert victims is None or all(v.band is Band.BATCH for v in victims)


@SETTINGS
@given(need=needs, free=frees, running=running_tasks(), now=nows, exempt=exempts)
def test_dropping_any_victim_leaves_the_job_short(
    need: dict[str, int], free: dict[str, int], running: list[RunningTask], now: int, exempt: int
) -> None:
    """Nothing is preempted in vain: the best set is minimal (dropping a victim never raises a key)."""
    victims = choose_victims(Band.PRODUCTION, need, free, running, now_ms=now, exempt_ms=exempt)
    if not victims:
        return
    for i in range(len(victims)):
        assert not _fits(need, free, victims[:i] + victims[i + 1 :])


@SETTINGS
@given(need=needs, free=frees, running=running_tasks(), now=nows)
def test_an_interactive_victim_only_when_batch_cannot_make_room(
    need: dict[str, int], free: dict[str, int], running: list[RunningTask], now: int
) -> None:
    victims = choose_victims(Band.PRODUCTION, need, free, running, now_ms=now)
    batch = [t for t in running if t.band is Band.BATCH]
    if victims and _fits(need, free, batch):
        assert all(v.band is Band.BATCH for v in victims)


@SETTINGS
@given(
    band=st.sampled_from([Band.INTERACTIVE]),
    need=needs,
    free=frees,
    running=running_tasks(),
    restart=st.integers(0, 10_000),
    exempt=st.integers(1, 5_000),
    data=st.data(),
)
def test_a_job_back_from_a_preemption_is_not_chosen_again_within_the_exemption(
    band: Band,
    need: dict[str, int],
    free: dict[str, int],
    running: list[RunningTask],
    restart: int,
    exempt: int,
    data: st.DataObject,
) -> None:
    """Issue 29, acceptance 3: a job preempted and restarted at ``restart`` is no victim of an
    interactive job at any time before ``restart + exempt``, whatever else runs; from then on it
    is a candidate again. (A production job overrides the exemption: the next test.)"""
    came_back = RunningTask(
        "came-back",
        Band.BATCH,
        data.draw(st.dictionaries(st.sampled_from(TOKENS), st.integers(1, 16), min_size=1, max_size=2)),
        started_ms=restart,
        preempted_before=data.draw(st.integers(1, 3)),
    )
    others = [
        RunningTask(t.task_id, t.band, t.amounts, restart - t.started_ms * 100, t.preempted_before)
        for t in running
    ]
    tasks = [*others, came_back]
    now = data.draw(st.integers(restart, restart + exempt - 1))
    victims = choose_victims(band, need, free, tasks, now_ms=now, exempt_ms=exempt)
    assert victims is None or "came-back" not in {v.task_id for v in victims}
    # Alone and needed: it waits out the exemption, and is taken from its end on.
    ends = restart + exempt
    lack = deficit(need, free)
    if lack and all(came_back.amounts.get(t, 0) >= n for t, n in lack.items()):
        assert choose_victims(band, need, free, [came_back], now_ms=ends - 1, exempt_ms=exempt) is None
        later = ends + data.draw(st.integers(0, 1_000))
        assert choose_victims(band, need, free, [came_back], now_ms=later, exempt_ms=exempt) == [came_back]


@SETTINGS
@given(need=needs, free=frees, running=running_tasks(), now=nows, exempt=st.integers(1, 14))
def test_production_takes_exempt_work_only_when_nothing_else_makes_room(
    need: dict[str, int], free: dict[str, int], running: list[RunningTask], now: int, exempt: int
) -> None:
    """The most protected band never waits for an exemption, and never uses it to churn: it takes
    an exempt victim only when the same bands' other work cannot make room."""
    victims = choose_victims(Band.PRODUCTION, need, free, running, now_ms=now, exempt_ms=exempt)
    every = choose_victims(Band.PRODUCTION, need, free, running, now_ms=now)
    # Whether it can run does not depend on the exemption.
    assert (victims is None) == (every is None)
    if not victims:
        return
    taken = [v for v in victims if is_exempt(v, now_ms=now, exempt_ms=exempt)]
    if taken:
        # Without them (and with every other allowed task of no more protected band than the
        # victims' own), nothing fits.
        top = min(int(v.band) for v in victims)
        others = [
            t
            for t in running
            if int(t.band) >= top
            and int(t.band) > int(Band.PRODUCTION)
            and not is_exempt(t, now_ms=now, exempt_ms=exempt)
        ]
        assert not _fits(need, free, others)


def test_lowest_band_then_least_work() -> None:
    """Concrete cases of the order: a batch job before an interactive one, the younger of two
    batch jobs of one size, and the least work before the fewest victims."""
    now = 1_000
    old_batch = RunningTask("old-batch", Band.BATCH, {"h100": 4}, started_ms=100)
    young_batch = RunningTask("young-batch", Band.BATCH, {"h100": 4}, started_ms=900)
    interactive = RunningTask("interactive", Band.INTERACTIVE, {"h100": 4}, started_ms=990)
    running = [old_batch, interactive, young_batch]
    picked = choose_victims(Band.PRODUCTION, {"h100": 4}, {}, running, now_ms=now)
    assert [v.task_id for v in picked or []] == ["young-batch"]
    picked = choose_victims(Band.PRODUCTION, {"h100": 8}, {}, running, now_ms=now)
    assert {v.task_id for v in picked or []} == {"young-batch", "old-batch"}
    # Two young batch jobs of 4 rather than one old batch gang of 8: the least work lost.
    gang = RunningTask("batch-gang", Band.BATCH, {"h100": 8}, started_ms=0)
    fresh = [RunningTask(f"fresh-{i}", Band.BATCH, {"h100": 4}, started_ms=950) for i in range(2)]
    picked = choose_victims(Band.PRODUCTION, {"h100": 8}, {}, [gang, *fresh], now_ms=now)
    assert {v.task_id for v in picked or []} == {"fresh-0", "fresh-1"}
    # Bands first: the gang (batch) rather than one young interactive job of 8.
    young_interactive = RunningTask("young-interactive", Band.INTERACTIVE, {"h100": 8}, started_ms=999)
    picked = choose_victims(Band.PRODUCTION, {"h100": 8}, {}, [gang, young_interactive], now_ms=now)
    assert [v.task_id for v in picked or []] == ["batch-gang"]
    # Equal work: the fewest victims (one 8-chip job of age 10 vs two 4-chip jobs of age 10).
    pair = [RunningTask(f"pair-{i}", Band.BATCH, {"h100": 4}, started_ms=990) for i in range(2)]
    one = RunningTask("one", Band.BATCH, {"h100": 8}, started_ms=995)
    assert work_lost(one, now) < sum(work_lost(p, now) for p in pair)
    picked = choose_victims(Band.PRODUCTION, {"h100": 8}, {}, [*pair, one], now_ms=now)
    assert [v.task_id for v in picked or []] == ["one"]
    same = RunningTask("same", Band.BATCH, {"h100": 8}, started_ms=990)
    picked = choose_victims(Band.PRODUCTION, {"h100": 8}, {}, [*pair, same], now_ms=now)
    assert [v.task_id for v in picked or []] == ["same"]
    # Free capacity counts: nothing to preempt when the job fits, only the shortfall otherwise.
    assert choose_victims(Band.PRODUCTION, {"h100": 4}, {"h100": 4}, running, now_ms=now) == []
    picked = choose_victims(Band.INTERACTIVE, {"h100": 6}, {"h100": 2}, running, now_ms=now)
    assert [v.task_id for v in picked or []] == ["young-batch"]
    assert choose_victims(Band.INTERACTIVE, {"h100": 16}, {}, running, now_ms=now) is None
    assert not may_preempt(Band.INTERACTIVE, Band.INTERACTIVE)
    assert may_preempt(Band.PRODUCTION, Band.BATCH)


def test_fewest_interactive_victims_when_batch_is_short() -> None:
    """A production job that needs more than batch holds takes as few interactive jobs as it
    can, even when two younger interactive jobs would lose less work than the batch one."""
    now = 10_000
    batch = RunningTask("batch", Band.BATCH, {"h100": 4}, started_ms=0)
    inter = [RunningTask(f"inter-{i}", Band.INTERACTIVE, {"h100": 4}, started_ms=9_990) for i in range(2)]
    picked = choose_victims(Band.PRODUCTION, {"h100": 8}, {}, [batch, *inter], now_ms=now)
    assert [v.task_id for v in picked or []] == ["inter-0", "batch"]  # most protected first


def test_a_restarted_gang_is_exempt_then_a_candidate_again() -> None:
    """No churn: the batch gang came back from a preemption at t=900; within the exemption the
    older fresh job goes instead, and with nothing else the job waits; after it, the least work."""
    came_back = RunningTask("batch/came-back", Band.BATCH, {"h100": 8}, started_ms=900, preempted_before=1)
    fresh = RunningTask("batch/fresh", Band.BATCH, {"h100": 8}, started_ms=100)
    interactive = RunningTask("inter/x", Band.INTERACTIVE, {"h100": 8}, started_ms=50)
    tasks = [came_back, fresh, interactive]
    assert choose_victims(Band.PRODUCTION, {"h100": 8}, {}, tasks, now_ms=1_000, exempt_ms=300) == [fresh]
    # Exempt and alone in its band: production still takes it rather than the interactive job
    # (bands first), and takes it rather than wait; an interactive job waits out the exemption.
    assert choose_victims(
        Band.PRODUCTION, {"h100": 8}, {}, [came_back, interactive], now_ms=1_000, exempt_ms=300
    ) == [came_back]
    assert choose_victims(Band.PRODUCTION, {"h100": 8}, {}, [came_back], now_ms=1_000, exempt_ms=300) == [
        came_back
    ]
    assert choose_victims(Band.INTERACTIVE, {"h100": 8}, {}, [came_back], now_ms=1_199, exempt_ms=300) is None
    # The exemption ends 300 ms after the restart; then it has lost less work than the fresh one.
    assert choose_victims(Band.PRODUCTION, {"h100": 8}, {}, tasks, now_ms=1_200, exempt_ms=300) == [came_back]
    # A job never preempted before is never exempt, however young.
    young = RunningTask("batch/young", Band.BATCH, {"h100": 8}, started_ms=1_000)
    assert choose_victims(Band.INTERACTIVE, {"h100": 8}, {}, [young], now_ms=1_000, exempt_ms=300) == [young]


def test_sixty_four_running_tasks_of_one_token() -> None:
    """A backend's size: 64 candidates, one token. The choice fits, is minimal, and no single swap
    of a victim for a non-victim that still fits is better (a cheap check of the exact optimum)."""
    rng = random.Random(29)
    now = 3_600_000
    tasks = [
        RunningTask(
            f"job-{i:02d}",
            rng.choice([Band.INTERACTIVE, Band.BATCH, Band.BATCH]),
            {"h100": rng.choice([1, 1, 2, 4, 8])},
            started_ms=rng.randrange(0, now),
            preempted_before=rng.choice([0, 0, 1]),
        )
        for i in range(64)
    ]
    start = time.perf_counter()
    victims = choose_victims(Band.PRODUCTION, {"h100": 32}, {}, tasks, now_ms=now, exempt_ms=600_000)
    elapsed = time.perf_counter() - start
    assert victims is not None and _fits({"h100": 32}, {}, victims)
    chosen = {v.task_id for v in victims}
    key = _key(tuple(victims), now)
    allowed = [t for t in tasks if not is_exempt(t, now_ms=now, exempt_ms=600_000)]
    for out in victims:
        for into in allowed:
            if into.task_id in chosen:
                continue
            swapped = (*(v for v in victims if v is not out), into)
            if _fits({"h100": 32}, {}, list(swapped)):
                assert _key(swapped, now) >= key
    print(f"64 tasks, one token, deficit 32: {elapsed * 1000:.1f} ms")
