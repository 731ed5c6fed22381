"""What a wake after eviction costs: `uv run python -m benchmarks.wake`.

A running job's workflow waits, idle, for its cluster's watcher to signal it. The worker keeps it
in its sticky cache (`[worker] max_cached_workflows`); one the cache evicted is replayed from its
whole history when the next signal comes. This times that replay, in this process, with the
worker's own workflow runner and payload converter (``temporalio.worker.Replayer``), for running
jobs' histories of growing length, and prints milliseconds per wake and per event.

The histories are a recorded one (tests/determinism/histories/end_confirmed_locally.json: a job
followed by its watcher) cut where the job runs, after the watcher's first re-signal of an
unchanged RUNNING, and lengthened by more such signals (six events each: the signal of a newer
version of the same RUNNING status, its workflow task, and the safety poll's timer restarted), as a
job running for days collects them.
Every length replays as the workflow code would have written it (the benchmark fails otherwise),
and stays under CONTINUE_AFTER_EVENTS, where a run continues as new.

The time to fetch the history from the server is not in it (the hold window of
``benchmarks.running`` counts those calls). The figure is a ratio to the shortest history, measured
in the same run; the absolute milliseconds depend on the machine. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import copy
import json
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from benchmarks.smoke import exit_now, parse_args
from iris.payloadcodec import Keyring
from iris.temporal import data_converter
from workflows.job import JobWorkflow
from workflows.job.steps.common import CONTINUE_AFTER_EVENTS
from workflows.runner import workflow_runner

SOURCE = (
    Path(__file__).resolve().parent.parent
    / "tests"
    / "determinism"
    / "histories"
    / "end_confirmed_locally.json"
)
# One re-signal of an unchanged state: the signal, its workflow task, the safety poll's timer
# cancelled and started again.
RESIGNAL = (
    "EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED",
    "EVENT_TYPE_WORKFLOW_TASK_SCHEDULED",
    "EVENT_TYPE_WORKFLOW_TASK_STARTED",
    "EVENT_TYPE_WORKFLOW_TASK_COMPLETED",
    "EVENT_TYPE_TIMER_CANCELED",
    "EVENT_TYPE_TIMER_STARTED",
)


def _resignal_at(events: list[dict[str, Any]]) -> int:
    """Where the recorded history's first re-signal of RUNNING begins."""
    types = [e["eventType"] for e in events]
    for i in range(len(events) - len(RESIGNAL) + 1):
        if (
            tuple(types[i : i + len(RESIGNAL)]) == RESIGNAL
            and i > 0
            and types[i - 1] == "EVENT_TYPE_TIMER_STARTED"
        ):
            return i
    raise SystemExit(f"{SOURCE.name}: no re-signal of an unchanged state to lengthen the history with")


def running_history(resignals: int) -> dict[str, Any]:
    """The recorded job, running, with ``resignals`` re-signals (at least the recorded one)."""
    recorded = json.loads(SOURCE.read_text())
    events: list[dict[str, Any]] = recorded["events"]
    start = _resignal_at(events)
    segment = events[start : start + len(RESIGNAL)]
    out = events[: start + len(RESIGNAL)]
    timer = out[-1]
    version = 1_000_000  # past every version the recorded history saw
    for _ in range(resignals - 1):
        base = len(out)
        ids = [str(base + i + 1) for i in range(len(RESIGNAL))]
        signaled, scheduled, started, completed, cancelled, restarted = copy.deepcopy(segment)
        for event, event_id in zip(
            (signaled, scheduled, started, completed, cancelled, restarted), ids, strict=True
        ):
            event["eventId"] = event_id
        # A newer version of the same status (the job changed, its state did not): the workflow
        # takes it and restarts its safety poll, as for the recorded one.
        payload = signaled["workflowExecutionSignaledEventAttributes"]["input"]["payloads"][0]
        observation = json.loads(base64.b64decode(payload["data"]))
        version += 1
        observation["status"]["version"] = version
        payload["data"] = base64.b64encode(json.dumps(observation).encode()).decode()
        started["workflowTaskStartedEventAttributes"]["scheduledEventId"] = ids[1]
        completed["workflowTaskCompletedEventAttributes"]["scheduledEventId"] = ids[1]
        completed["workflowTaskCompletedEventAttributes"]["startedEventId"] = ids[2]
        previous = timer["timerStartedEventAttributes"]["timerId"]
        cancel = cancelled["timerCanceledEventAttributes"]
        cancel["timerId"] = previous
        cancel["startedEventId"] = timer["eventId"]
        cancel["workflowTaskCompletedEventId"] = ids[3]
        begin = restarted["timerStartedEventAttributes"]
        begin["timerId"] = str(int(previous) + 1)
        begin["workflowTaskCompletedEventId"] = ids[3]
        out += [signaled, scheduled, started, completed, cancelled, restarted]
        timer = restarted
    return {**recorded, "events": out}


def job_id(data: dict[str, Any]) -> str:
    """The job id the start input names: a run replays only under its own id (a signed spec
    runs under its job id alone)."""
    start = data["events"][0]["workflowExecutionStartedEventAttributes"]
    spec = json.loads(base64.b64decode(start["input"]["payloads"][0]["data"]))
    return str(spec["job_id"])


async def time_replays(history: WorkflowHistory, repeat: int) -> float:
    """Seconds per replay of ``history`` (``repeat`` replays through one replayer)."""
    replayer = Replayer(
        workflows=[JobWorkflow],
        data_converter=data_converter(Keyring.generate()),
        workflow_runner=workflow_runner(),
    )

    async def copies() -> AsyncIterator[WorkflowHistory]:
        for _ in range(repeat):
            yield history

    started = time.perf_counter()
    results = await replayer.replay_workflows(copies(), raise_on_replay_failure=False)
    elapsed = time.perf_counter() - started
    failures = {k: v for k, v in results.replay_failures.items() if v is not None}
    if failures:
        raise SystemExit(f"a lengthened history no longer replays: {next(iter(failures.values()))}")
    return elapsed / repeat


async def run(args: argparse.Namespace) -> int:
    print(f"histories: {SOURCE.name}, cut at its first re-signal of RUNNING and lengthened")
    print(f"{'re-signals':>10} {'events':>7} {'ms/wake':>9} {'µs/event':>9} {'× shortest':>11}")
    rows: list[tuple[int, int, float]] = []
    for count in args.resignals:
        data = running_history(count)
        events = len(data["events"])
        if events >= CONTINUE_AFTER_EVENTS:
            print(
                f"{count:>10} {events:>7}  skipped: a run continues as new at {CONTINUE_AFTER_EVENTS} events"
            )
            continue
        history = WorkflowHistory.from_json(job_id(data), data)
        await time_replays(history, 1)  # the first replay of a length imports and warms up
        samples = [await time_replays(history, args.repeat) for _ in range(args.rounds)]
        seconds = statistics.median(samples)
        rows.append((count, events, seconds))
        shortest = rows[0][2]
        per_event = seconds / events * 1e6
        print(f"{count:>10} {events:>7} {seconds * 1000:>9.2f} {per_event:>9.1f} {seconds / shortest:>11.2f}")
    if len(rows) >= 2:
        (_, n0, t0), (_, n1, t1) = rows[0], rows[-1]
        per_event = (t1 - t0) / (n1 - n0)
        fixed = t0 - per_event * n0
        print(f"fit: a wake replays in {fixed * 1000:.2f} ms + {per_event * 1e6:.1f} µs per event")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--resignals",
        type=lambda text: [int(x) for x in text.split(",") if x.strip()],
        default=[1, 25, 75, 150, 300],
        help="re-signals in each history, comma-separated (1 is the recorded one)",
    )
    parser.add_argument("--repeat", type=int, default=20, help="replays per timing")
    parser.add_argument("--rounds", type=int, default=5, help="timings per length (the median is shown)")
    args = parse_args(parser, {"resignals": [1, 10], "repeat": 2, "rounds": 1}, argv)
    if min(args.resignals, default=0) < 1 or args.repeat < 1 or args.rounds < 1:
        parser.error("--resignals, --repeat and --rounds take positive numbers")
    return asyncio.run(run(args))


if __name__ == "__main__":
    exit_now(main())
