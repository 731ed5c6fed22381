"""Property tests of the victim choice (docs/DESIGN.md, "Preemption"): the fewest, lowest-band,
least-preempted-before, youngest victims that make the job fit; never an equal or higher band;
``batch`` preempts nothing."""

from __future__ import annotations

import itertools

from budget import scaled
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iris.policy import Band
from iris.policy.preemption import RunningTask, choose_victims, deficit, may_preempt, victim_rank

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
                started_ms=draw(st.integers(0, 5)),  # ties in start time happen
                preempted_before=draw(st.integers(0, 2)),
            )
        )
    return tasks


needs = st.dictionaries(st.sampled_from(TOKENS), st.integers(1, 16), min_size=1, max_size=2)
frees = st.dictionaries(st.sampled_from(TOKENS), st.integers(0, 8), max_size=3)


def _fits(need: dict[str, int], free: dict[str, int], victims: list[RunningTask]) -> bool:
    return all(free.get(t, 0) + sum(v.amounts.get(t, 0) for v in victims) >= n for t, n in need.items())


def _best(
    band: Band, need: dict[str, int], free: dict[str, int], running: list[RunningTask]
) -> set[str] | None:
    """The reference: every allowed subset, the fewest, then the lowest bands, then the fewest
    earlier preemptions, then the youngest."""
    allowed = [t for t in running if int(t.band) > int(band)]
    best: tuple[int, list[tuple[int, int, int, str]]] | None = None
    chosen: set[str] | None = None
    for k in range(len(allowed) + 1):
        for combo in itertools.combinations(allowed, k):
            if not _fits(need, free, list(combo)):
                continue
            key = (k, sorted((victim_rank(t) for t in combo), reverse=True))
            if best is None or key < best:
                best, chosen = key, {t.task_id for t in combo}
        if chosen is not None:
            return chosen
    return None


@SETTINGS
@given(band=st.sampled_from(list(Band)), need=needs, free=frees, running=running_tasks())
def test_victims_are_the_best_allowed_set(
    band: Band, need: dict[str, int], free: dict[str, int], running: list[RunningTask]
) -> None:
    victims = choose_victims(band, need, free, running)
    expected = _best(band, need, free, running)
    if expected is None:
        assert victims is None  # no allowed set makes the job fit
        return
    assert victims is not None
    ids = [v.task_id for v in victims]
    assert len(ids) == len(set(ids))
    # Never an equal or higher band; the release makes the job fit; minimal and lowest band first.
    assert all(int(v.band) > int(band) for v in victims)
    assert _fits(need, free, victims)
    assert len(victims) == len(expected)
    assert {v.task_id for v in victims} == expected


@SETTINGS
@given(need=needs, free=frees, running=running_tasks())
def test_batch_preempts_nothing(
    need: dict[str, int], free: dict[str, int], running: list[RunningTask]
) -> None:
    victims = choose_victims(Band.BATCH, need, free, running)
    assert victims == ([] if not deficit(need, free) else None)


@SETTINGS
@given(need=needs, free=frees, running=running_tasks())
def test_interactive_never_preempts_interactive_or_production(
    need: dict[str, int], free: dict[str, int], running: list[RunningTask]
) -> None:
    victims = choose_victims(Band.INTERACTIVE, need, free, running)
    assert victims is None or all(v.band is Band.BATCH for v in victims)


@SETTINGS
@given(need=needs, free=frees, running=running_tasks())
def test_dropping_any_victim_leaves_the_job_short(
    need: dict[str, int], free: dict[str, int], running: list[RunningTask]
) -> None:
    victims = choose_victims(Band.PRODUCTION, need, free, running)
    if not victims:
        return
    for i in range(len(victims)):
        assert not _fits(need, free, victims[:i] + victims[i + 1 :])


def test_lowest_band_then_youngest() -> None:
    """Concrete cases of the order: a batch job before an interactive one of the same size, the
    younger of two batch jobs, and fewer victims before lower bands."""
    old_batch = RunningTask("old-batch", Band.BATCH, {"h100": 4}, started_ms=1)
    young_batch = RunningTask("young-batch", Band.BATCH, {"h100": 4}, started_ms=9)
    interactive = RunningTask("interactive", Band.INTERACTIVE, {"h100": 4}, started_ms=20)
    running = [old_batch, interactive, young_batch]
    picked = choose_victims(Band.PRODUCTION, {"h100": 4}, {}, running)
    assert [v.task_id for v in picked or []] == ["young-batch"]
    picked = choose_victims(Band.PRODUCTION, {"h100": 8}, {}, running)
    assert {v.task_id for v in picked or []} == {"young-batch", "old-batch"}
    # One interactive job of 8 rather than two batch jobs of 4: fewest first.
    big = RunningTask("big-interactive", Band.INTERACTIVE, {"h100": 8}, started_ms=0)
    picked = choose_victims(Band.PRODUCTION, {"h100": 8}, {}, [old_batch, young_batch, big])
    assert [v.task_id for v in picked or []] == ["big-interactive"]
    # Free capacity counts: nothing to preempt when the job fits, only the shortfall otherwise.
    assert choose_victims(Band.PRODUCTION, {"h100": 4}, {"h100": 4}, running) == []
    picked = choose_victims(Band.INTERACTIVE, {"h100": 6}, {"h100": 2}, running)
    assert [v.task_id for v in picked or []] == ["young-batch"]
    assert choose_victims(Band.INTERACTIVE, {"h100": 16}, {}, running) is None
    assert not may_preempt(Band.INTERACTIVE, Band.INTERACTIVE)
    assert may_preempt(Band.PRODUCTION, Band.BATCH)


def test_a_job_preempted_before_is_spared_for_a_fresh_one_of_its_band() -> None:
    """No churn: the youngest batch job came back from a preemption (it is young because it
    restarted), so the older batch job that was never preempted goes first."""
    came_back = RunningTask("batch/came-back", Band.BATCH, {"h100": 8}, started_ms=900, preempted_before=1)
    fresh = RunningTask("batch/fresh", Band.BATCH, {"h100": 8}, started_ms=100)
    interactive = RunningTask("inter/x", Band.INTERACTIVE, {"h100": 8}, started_ms=50)

    victims = choose_victims(Band.PRODUCTION, {"h100": 8}, {}, [came_back, fresh, interactive])
    assert victims == [fresh]
    # The band still comes first: batch before interactive, however often it was preempted.
    assert choose_victims(Band.PRODUCTION, {"h100": 8}, {}, [came_back, interactive]) == [came_back]
    # And the fewest victims before anything: one 8-chip victim rather than two fresh 4-chip ones.
    halves = [RunningTask(f"batch/half-{i}", Band.BATCH, {"h100": 4}, started_ms=500) for i in range(2)]
    assert choose_victims(Band.INTERACTIVE, {"h100": 8}, {}, [came_back, *halves]) == [came_back]
