"""Each process of the running stack holds only its own cluster's secrets (issue 16, acceptance 3;
docs/DESIGN.md, "Where secrets live", "Credentials").

The home worker (this test process: its environment, its key directory, its config file) holds no
peer's object-store credential and no peer's private key; each controller (``/proc/<pid>/environ``
and the key directory it was started with) holds exactly its own private key and no other cluster's
store credentials. The same check runs again when each session stack stops (tests/conftest.py), so
it holds over the whole e2e suite. Artifact checks, which the destination's controller does with
its own credentials, still pass and fail.
"""

from __future__ import annotations

import asyncio

from isolation import isolation_violations, private_key_bytes
from stack import Stack, wait_until

from iris.jobs import JobState


async def test_artifact_checks_work_with_each_process_holding_only_its_own_secrets(stack: Stack) -> None:
    await asyncio.to_thread(stack.put_artifact, "cw-rno2a-artifacts", "isolation/present")
    ok = await stack.iris.submit(
        ["true"],
        name="isolation-ok",
        target_cluster="cw-rno2a",
        artifacts=["s3://cw-rno2a-artifacts/isolation/present"],
    )
    missing = await stack.iris.submit(
        ["true"],
        name="isolation-missing",
        target_cluster="cw-us-east-02a",
        artifacts=["s3://cw-us-east-02a-artifacts/isolation/absent"],
    )
    assert (await stack.iris.wait(ok, timeout_s=90)).state is JobState.SUCCEEDED

    async def refused() -> bool:
        return (await stack.iris.describe(missing)).state is JobState.HANDOFF_FAILED

    await wait_until(refused, timeout=60, what="the missing artifact's refusal")
    status = await stack.iris.describe(missing)
    assert "missing in cw-us-east-02a's object store" in status.reason
    await stack.iris.cancel(missing)
    assert isolation_violations(stack) == []


def test_no_two_clusters_share_a_private_key(stack: Stack) -> None:
    keys = private_key_bytes(stack)
    assert set(keys) == set(stack.config.cluster_names)
    assert len(set(keys.values())) == len(keys)
