"""The Temporal worker: every workflow and activity of the federation on one task queue."""

from __future__ import annotations

import asyncio

from temporalio.client import Client
from temporalio.worker import Worker

from activities.peers import PeerActivities
from iris.config import FederationConfig, load_config
from iris.temporal import connect
from workflows.job import JobWorkflow


def build_worker(client: Client, config: FederationConfig) -> Worker:
    peers = PeerActivities(config)
    return Worker(
        client,
        task_queue=config.temporal.task_queue,
        workflows=[JobWorkflow],
        activities=[peers.fetch_reports, peers.launch_job, peers.mirror_job, peers.terminate_job],
        max_concurrent_activities=200,
    )


async def run_worker(config: FederationConfig) -> None:
    client = await connect(config)
    async with build_worker(client, config):
        await asyncio.Event().wait()


def main(config_file: str | None = None) -> None:
    asyncio.run(run_worker(load_config(config_file)))


if __name__ == "__main__":
    main()
