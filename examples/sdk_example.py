"""The Python SDK in one screen: submit, follow, read logs, cancel.

Run it against `uv run iris dev` (in another terminal):

    uv run python examples/sdk_example.py
"""

from __future__ import annotations

from iris.client import IrisClient
from iris.jobs import JobState


def main() -> int:
    with IrisClient(cluster="marin") as client:
        # Needs 8 H100: the home cluster has none, so the job federates to a CoreWeave peer.
        job_id = client.submit(
            ["python", "-c", "print('hello from the SDK')"], device_type="h100", gpu_count=8
        )
        print(f"submitted {job_id}")
        status = client.wait(job_id, timeout_s=120)
        print(f"{job_id}: {status.state.value} on {status.cluster} (exit code {status.exit_code})")
        print(client.logs(job_id).data, end="")

        # A cancel reports whether it won the race against the handoff.
        long_job = client.submit(["sleep", "600"], device_type="h100", gpu_count=8, replicas=3)
        outcome = client.cancel_and_report(long_job)
        print(f"{long_job}: cancel {'won' if outcome.won else 'lost'}: {outcome.message}")

        mine = [row.job_id for row in client.list() if row.job_id in (job_id, long_job)]
        print(f"listed {len(mine)} of my 2 jobs")
        return 0 if status.state is JobState.SUCCEEDED else 1


if __name__ == "__main__":
    raise SystemExit(main())
