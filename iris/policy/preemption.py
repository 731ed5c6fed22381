"""Which running work a waiting job preempts (docs/DESIGN.md, "Preemption").

Pure: a backend passes in the waiting job's band and need, its free amounts and what its running
tasks hold, and gets back the victims to stop, or None. A band preempts only strictly lower bands
(a higher ``Band`` number): ``batch`` preempts nothing, ``interactive`` preempts ``batch``,
``production`` preempts both.

The choice, among the sets of allowed victims whose release makes the job fit:

1. the fewest victims;
2. then the lowest bands: the set whose highest-band (least preemptible) victim is the most
   preemptible, then its next victim, and so on;
3. then, at equal bands, the ones preempted (or lost) fewer times before: a job that came back
   from a preemption is not the first victim again, so no job is preempted over and over;
4. then the youngest: the latest started (the least work lost).

In other words the set whose victims, ranked from the least to the most preemptible, are
lexicographically the most preemptible (``victim_rank``).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from iris.policy.models import Band


@dataclass(frozen=True)
class RunningTask:
    """One running unit a backend could stop: its id (a job id), band, what it holds per token,
    when it started (ms), and how many earlier attempts of its job were preempted or lost."""

    task_id: str
    band: Band
    amounts: Mapping[str, int]
    started_ms: int
    preempted_before: int = 0


def may_preempt(waiting: Band, running: Band) -> bool:
    """Whether a job of band ``waiting`` may preempt one of band ``running``: strictly lower only."""
    return int(running) > int(waiting)


def victim_rank(task: RunningTask) -> tuple[int, int, int, str]:
    """Smaller is preempted first: the lowest band (highest number), then the fewest earlier
    preemptions, then the youngest."""
    return (-int(task.band), task.preempted_before, -task.started_ms, task.task_id)


def deficit(need: Mapping[str, int], free: Mapping[str, int]) -> dict[str, int]:
    """What the job lacks per token (tokens it fully has are left out)."""
    return {t: n - free.get(t, 0) for t, n in need.items() if n - free.get(t, 0) > 0}


def _covers(tasks: Sequence[RunningTask], lack: Mapping[str, int]) -> bool:
    return all(sum(task.amounts.get(t, 0) for task in tasks) >= n for t, n in lack.items())


def _feasible(k: int, pool: Sequence[RunningTask], lack: Mapping[str, int]) -> bool:
    """Whether some ``k`` of ``pool`` release what ``lack`` asks."""
    if k < 0 or k > len(pool):
        return False
    if not lack:
        return True
    if k == 0:
        return False
    if len(lack) == 1:
        # One token (every backend's case: a job asks one device token, or CPU slots): the k
        # largest holders are the best k.
        ((token, n),) = lack.items()
        return sum(sorted((t.amounts.get(token, 0) for t in pool), reverse=True)[:k]) >= n
    return any(_covers(combo, lack) for combo in itertools.combinations(pool, k))


def _remaining(lack: Mapping[str, int], task: RunningTask) -> dict[str, int]:
    return {t: n - task.amounts.get(t, 0) for t, n in lack.items() if n - task.amounts.get(t, 0) > 0}


def choose_victims(
    band: Band,
    need: Mapping[str, int],
    free: Mapping[str, int],
    running: Sequence[RunningTask],
) -> list[RunningTask] | None:
    """The victims whose release makes ``need`` fit (see the module's order), least preemptible
    first; ``[]`` if it fits already; None if no set of allowed victims would make it fit."""
    lack = deficit(need, free)
    if not lack:
        return []
    # Only allowed victims that hold some of what is lacking can help; a useless one never
    # belongs to a minimal set.
    pool = sorted(
        (t for t in running if may_preempt(band, t.band) and any(t.amounts.get(tok, 0) > 0 for tok in lack)),
        key=victim_rank,
    )
    k = next((k for k in range(1, len(pool) + 1) if _feasible(k, pool, lack)), None)
    if k is None:
        return None
    # Fix the least preemptible victim first, as preemptible as possible: the first prefix of the
    # ranked pool that can still hold a k-set ends with it; then the next one within that prefix.
    chosen: list[RunningTask] = []
    candidates = pool
    while lack:
        slots = k - len(chosen)
        i = next(i for i in range(slots, len(candidates) + 1) if _feasible(slots, candidates[:i], lack))
        victim = candidates[i - 1]
        chosen.append(victim)
        lack = _remaining(lack, victim)
        candidates = candidates[: i - 1]
    return chosen
