"""A job run with the payload codec (docs/SECURITY.md, "Payload encryption"): the worker reads what
the client encrypted and the job runs as ever; its history holds its env only as ciphertext, its
search attributes stay readable for the Web UI's filter, and it replays with the key ring and
with no ring refuses, naming the key."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
from job_doubles import cpu_spec, running_federation
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer

from iris import devstack
from iris.contract import MEMO_REASON, SA_STATE, SEARCH_ATTRIBUTE_KEYS
from iris.jobs import JobState
from iris.payloadcodec import ENCODING, Keyring
from iris.temporal import data_converter
from workflows.job import JobWorkflow
from workflows.runner import workflow_runner

SECRET = "hunter2-alice"
RING = Keyring.generate()


@pytest.fixture(scope="module")
async def sealed_env() -> AsyncIterator[WorkflowEnvironment]:
    """The dev server, its client (and so the worker) with the ring's codec."""
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(devstack.venv_bin("temporal")),
        search_attributes=SEARCH_ATTRIBUTE_KEYS,
        data_converter=data_converter(RING),
        dev_server_startup_timeout=timedelta(seconds=60),
    )
    try:
        yield env
    finally:
        await env.shutdown()


async def test_an_encrypted_job_runs_hides_its_env_and_replays_with_the_ring(
    sealed_env: WorkflowEnvironment,
) -> None:
    async for fed in running_federation(sealed_env):
        spec = cpu_spec("sealed", fed.now_ms, env={"SECRET_TOKEN_ALICE": SECRET})
        handle = await fed.start(spec)
        status = await fed.result(handle)
        assert status.state is JobState.SUCCEEDED, status.reason
        # The worker decrypted the start and handed the activity the env; the client reads it back.
        assert [r.request.env for r in fed.fake.launch_requests] == [{"SECRET_TOKEN_ALICE": SECRET}]
        assert status.spec is not None and status.spec.env == {"SECRET_TOKEN_ALICE": SECRET}

        history = await handle.fetch_history()
        raw = history.to_json()
        for hidden in (SECRET, "SECRET_TOKEN_ALICE"):
            assert hidden not in raw and base64.b64encode(hidden.encode()).decode()[:12] not in raw
        assert base64.b64encode(ENCODING).decode() in raw
        # What the Web UI filters on is not a payload of the codec; the memo is, and decrypts.
        desc = await handle.describe()
        assert desc.typed_search_attributes.get(SA_STATE) == JobState.SUCCEEDED.value
        assert (await desc.memo())[MEMO_REASON] == status.reason

        def replayer(ring: Keyring | None) -> Replayer:
            return Replayer(
                workflows=[JobWorkflow],
                data_converter=data_converter(ring),
                workflow_runner=workflow_runner(),
            )

        keyed = await replayer(RING).replay_workflow(history, raise_on_replay_failure=False)
        assert keyed.replay_failure is None, keyed.replay_failure
        rotated = await replayer(RING.rotated()).replay_workflow(history, raise_on_replay_failure=False)
        assert rotated.replay_failure is None, rotated.replay_failure
        keyless = await replayer(None).replay_workflow(history, raise_on_replay_failure=False)
        assert keyless.replay_failure is not None
        assert RING.current in str(keyless.replay_failure)
