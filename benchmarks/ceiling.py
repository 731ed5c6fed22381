"""The engine's ceiling: a no-op workflow shaped like a real job, on the same server.

``CeilingWorkflow`` runs the steps a real ``JobWorkflow`` of its kind runs, in the same order, as
read from real histories: each activity, local activity and signal wait ("a", "l", "s"). Every
activity returns at once; the step just before a signal wait registers the workflow with a
zero-cost ticker in the worker process, which signals it at once (the stand-in for the placement
tick, which also signals jobs from the worker after their enqueue step). No search-attribute
upserts, no controller, no store: what is left is Temporal's own cost per job.

Run as its own process, like ``iris worker``::

    python -m benchmarks.ceiling --address 127.0.0.1:7233 --task-queue bench-ceiling
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from datetime import timedelta

from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.common import RetryPolicy
from temporalio.worker import Worker

with workflow.unsafe.imports_passed_through():
    from pydantic import BaseModel

    from benchmarks.smoke import exit_now

CEILING_WORKFLOW = "CeilingWorkflow"


class CeilingInput(BaseModel):
    """One job's shape: its steps in order, "a" activity, "l" local activity, "s" one signal."""

    steps: str = "a"


_RETRY = RetryPolicy(maximum_attempts=3)
_TIMEOUT = timedelta(seconds=30)


@workflow.defn(name=CEILING_WORKFLOW)
class CeilingWorkflow:
    def __init__(self) -> None:
        self._signals = 0

    @workflow.signal
    def poke(self) -> None:
        self._signals += 1

    @workflow.run
    async def run(self, inp: CeilingInput) -> int:
        steps = inp.steps
        awaited = 0
        for i, step in enumerate(steps):
            if step == "s":
                awaited += 1
                await workflow.wait_condition(lambda n=awaited: self._signals >= n)  # type: ignore[misc]
                continue
            # The step before a run of signal waits is the "enqueue": it asks the ticker for them.
            wanted = len(steps[i + 1 :]) - len(steps[i + 1 :].lstrip("s"))
            name, arg = ("ceiling_enqueue", wanted) if wanted else ("ceiling_noop", i)
            if step == "l":
                await workflow.execute_local_activity(
                    name, arg, start_to_close_timeout=_TIMEOUT, retry_policy=_RETRY
                )
            else:
                await workflow.execute_activity(
                    name, arg, start_to_close_timeout=_TIMEOUT, retry_policy=_RETRY
                )
        return self._signals


class Ticker:
    """Signals enqueued workflows as soon as it is woken, like a placement tick that costs nothing."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._pending: list[tuple[str, int]] = []
        self._wake = asyncio.Event()

    @activity.defn(name="ceiling_noop")
    async def noop(self, i: int) -> int:
        return i

    @activity.defn(name="ceiling_enqueue")
    async def enqueue(self, signals: int) -> None:
        workflow_id = activity.info().workflow_id
        assert workflow_id is not None
        self._pending.append((workflow_id, signals))
        self._wake.set()

    async def _poke(self, workflow_id: str) -> None:
        with contextlib.suppress(Exception):
            await self._client.get_workflow_handle(workflow_id).signal("poke")

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)
            self._wake.clear()
            batch, self._pending = self._pending, []
            if batch:
                await asyncio.gather(*(self._poke(wf) for wf, n in batch for _ in range(n)))


async def serve(address: str, task_queue: str, max_concurrent_activities: int) -> None:
    from iris.payloadcodec import load_keyring
    from iris.temporal import data_converter

    client = await Client.connect(address, data_converter=data_converter(load_keyring()))
    ticker = Ticker(client)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    worker = Worker(
        client,
        task_queue=task_queue,
        workflows=[CeilingWorkflow],
        activities=[ticker.noop, ticker.enqueue],
        # The same worker settings as worker/main.py.
        max_concurrent_activities=max_concurrent_activities,
    )
    tick_task = asyncio.create_task(ticker.run())
    async with worker:
        await stop.wait()
    tick_task.cancel()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", required=True)
    p.add_argument("--task-queue", required=True)
    p.add_argument("--max-concurrent-activities", type=int, default=200)
    args = p.parse_args()
    asyncio.run(serve(args.address, args.task_queue, args.max_concurrent_activities))
    exit_now(0)


if __name__ == "__main__":
    main()
