"""Which running work a waiting job preempts (docs/DESIGN.md, "Preemption").

Pure: a backend passes in the waiting job's band and need, its free amounts, what its running
tasks hold, the time and the cluster's exemption, and gets back the victims to stop, or None. A
band preempts only strictly lower bands (a higher ``Band`` number): ``batch`` preempts nothing,
``interactive`` preempts ``batch``, ``production`` preempts both.

A task whose job was preempted (or lost) before and whose attempt started less than
``exempt_ms`` ago is exempt (``preempt_exempt_s``, like Slurm's ``PreemptExemptTime``): no
``interactive`` job takes it as a victim, so a job back from a preemption runs for at least that
long unless ``production`` work needs its devices. The most protected band overrides the
exemption (``overrides_exemption``): an exemption bounds churn, and must not make the top band
wait (docs/DESIGN.md, "Preemption").

The choice, among the sets of allowed victims (non-exempt ones, unless the waiting job's band
overrides the exemption) whose release makes the job fit:

1. the lowest bands: the fewest victims of each band above ``batch``, the most protected first
   (a ``production`` job takes an ``interactive`` one only when ``batch`` work cannot make room,
   and then as few as it can); ``batch`` victims are weighed by the next keys alone;
2. then the fewest exempt victims (only a ``production`` job may take one, and it does so only
   when other work of the same bands cannot make room: a job just back from a preemption is the
   youngest, so without this key it would be the cheapest victim again);
3. then the least work lost (``work_lost``): each victim's amounts (all its tokens) times the time
   since its attempt started, summed;
4. then the fewest victims;
5. then, by task id, the set whose smallest differing id is its own (deterministic).

Exact and fast (``_best``): every key is a sum over the victims (the id key as a bit mask), so a
0/1 knapsack over what is still lacking finds the best set: O(n · S) for n candidates and S the
reachable lack vectors, S ≤ deficit + 1 for one token (every backend's case). Measured (2 loaded
cores, nice 19), 64 candidates of 1 to 8 chips: a median of 1 ms a call for a deficit of 8, 3 ms
for 32, 6 ms for 64.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from iris.policy.models import Band


@dataclass(frozen=True)
class RunningTask:
    """One running unit a backend could stop: its id (a job id), band, what it holds per token,
    when its attempt started (ms), and how many earlier attempts of its job were preempted or lost."""

    task_id: str
    band: Band
    amounts: Mapping[str, int]
    started_ms: int
    preempted_before: int = 0


# Bands whose victims are counted before the work lost (all but the least protected one), the
# most protected first.
_COUNTED_BANDS: tuple[Band, ...] = tuple(sorted(Band))[:-1]
_MOST_PROTECTED = min(Band)


def may_preempt(waiting: Band, running: Band) -> bool:
    """Whether a job of band ``waiting`` may preempt one of band ``running``: strictly lower only."""
    return int(running) > int(waiting)


def overrides_exemption(waiting: Band) -> bool:
    """Whether a job of band ``waiting`` may preempt exempt work too: the most protected band."""
    return waiting == _MOST_PROTECTED


def is_exempt(task: RunningTask, *, now_ms: int, exempt_ms: int) -> bool:
    """Whether ``task`` came back from a preemption (or a loss) less than ``exempt_ms`` ago (a
    start after ``now_ms``, a clock's skew, counts as just now; ``exempt_ms`` 0 exempts no one)."""
    return exempt_ms > 0 and task.preempted_before > 0 and now_ms - task.started_ms < exempt_ms


def work_lost(task: RunningTask, now_ms: int) -> int:
    """What stopping ``task`` now loses: its amounts times the time since its attempt started
    (unit-milliseconds; a start in the future counts as now)."""
    return sum(max(0, a) for a in task.amounts.values()) * max(0, now_ms - task.started_ms)


def deficit(need: Mapping[str, int], free: Mapping[str, int]) -> dict[str, int]:
    """What the job lacks per token (tokens it fully has are left out)."""
    return {t: n - free.get(t, 0) for t, n in need.items() if n - free.get(t, 0) > 0}


def _best(
    pool: Sequence[RunningTask], lack: Mapping[str, int], now_ms: int, exempt: frozenset[str] = frozenset()
) -> list[RunningTask] | None:
    """The best set of ``pool`` that covers ``lack``, or None; ``exempt``: the ids of exempt
    members (weighed by the exempt key).

    A 0/1 knapsack over the lack still to cover (capped at 0 per token). A set's key is the sum of
    its members' keys: (a one per counted band, a one if exempt, work lost, 1, -2^(n-1-r)) with r
    the member's rank by id, so the bit mask's negation orders sets of one size by their smallest
    differing id, and decodes the set. Lexicographic order on integer tuples is kept by adding the
    same tuple to both sides, so extending the best cover of a smaller lack with a member is never
    worse than extending another: the table is exact."""
    tokens = sorted(lack)
    n = len(pool)
    by_id = sorted(range(n), key=lambda i: (pool[i].task_id, i))
    bit = {i: 1 << (n - 1 - r) for r, i in enumerate(by_id)}
    width = len(_COUNTED_BANDS)
    start = tuple(lack[t] for t in tokens)
    best: dict[tuple[int, ...], tuple[int, ...]] = {start: (0,) * (width + 4)}
    for i, task in enumerate(pool):
        held = [task.amounts.get(t, 0) for t in tokens]
        item = (
            *(1 if task.band == b else 0 for b in _COUNTED_BANDS),
            1 if task.task_id in exempt else 0,
            work_lost(task, now_ms),
            1,
            -bit[i],
        )
        for state, key in list(best.items()):
            if not any(state):
                continue  # covered: adding a victim only makes it worse
            after = tuple(max(0, s - h) for s, h in zip(state, held, strict=True))
            if after == state:
                continue
            candidate = tuple(a + b for a, b in zip(key, item, strict=True))
            current = best.get(after)
            if current is None or candidate < current:
                best[after] = candidate
    done = best.get((0,) * len(tokens))
    if done is None:
        return None
    mask = -done[-1]
    return [pool[i] for i in range(n) if mask & bit[i]]


def choose_victims(
    band: Band,
    need: Mapping[str, int],
    free: Mapping[str, int],
    running: Sequence[RunningTask],
    *,
    now_ms: int,
    exempt_ms: int = 0,
) -> list[RunningTask] | None:
    """The victims whose release makes ``need`` fit (see the module's order), least preemptible
    first (the most protected band, then the most work); ``[]`` if it fits already; None if no set
    of allowed victims would make it fit. ``now_ms`` is the time the work lost and the exemption
    are measured at; ``exempt_ms`` the cluster's ``preempt_exempt_s`` in ms."""
    lack = deficit(need, free)
    if not lack:
        return []
    overrides = overrides_exemption(band)
    # Only allowed victims that hold some of what is lacking can help (exempt ones only for a band
    # that overrides the exemption); a useless one never belongs to the best set (dropping it
    # lowers every key).
    pool: list[RunningTask] = []
    exempt: set[str] = set()
    for t in running:
        if not may_preempt(band, t.band) or not any(t.amounts.get(tok, 0) > 0 for tok in lack):
            continue
        if is_exempt(t, now_ms=now_ms, exempt_ms=exempt_ms):
            if not overrides:
                continue
            exempt.add(t.task_id)
        pool.append(t)
    if any(sum(t.amounts.get(tok, 0) for t in pool) < n for tok, n in lack.items()):
        return None
    chosen = _best(pool, lack, now_ms, frozenset(exempt))
    if chosen is None:
        return None
    return sorted(chosen, key=lambda t: (int(t.band), -work_lost(t, now_ms), t.task_id))
