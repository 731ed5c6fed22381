"""What the Web UI and `iris job list` see without querying the job (docs/DESIGN.md, "What
operators see"): the ``IrisState`` / ``IrisPeer`` search attributes and the memo's reason, as the
workflow upserts them."""

from __future__ import annotations

from job_doubles import BUNDLE, HOME, PEER, Federation, cpu_spec, gpu_spec, listed, upserted, wait_for

from iris.contract import MEMO_REASON, SA_PEER, SA_STATE
from iris.controller.models import ControllerJobState
from iris.jobs import JobState
from iris.policy import QUEUED_REASON
from iris.policy.models import DeviceRequest


async def test_iris_state_follows_the_job_and_is_upserted_only_when_it_changes(fed: Federation) -> None:
    fed.fake.mirror = [ControllerJobState.RUNNING, ControllerJobState.SUCCEEDED]
    handle = await fed.queued(gpu_spec("visible", fed.now_ms, bundle=BUNDLE, artifacts=["s3://x/y"]))
    await fed.place(handle)
    await fed.result(handle)

    # CLASSIFYING is set by the client at start; PENDING_HANDOFF changes its reason three times
    # (promoted, checking artifacts, awaiting acceptance) but is upserted once per entry.
    assert await upserted(handle, SA_STATE) == [
        "QUEUED_HANDOFF",
        "PENDING_HANDOFF",
        "BUILDING",
        "PENDING_HANDOFF",
        "HANDED_OFF",
        "RUNNING",
        "SUCCEEDED",
    ]
    assert await upserted(handle, SA_PEER) == [PEER]
    desc = await handle.describe()
    assert desc.typed_search_attributes.get(SA_STATE) == "SUCCEEDED"
    assert desc.typed_search_attributes.get(SA_PEER) == PEER


async def test_a_job_run_at_home_names_home_as_its_peer(fed: Federation) -> None:
    handle = await fed.start(cpu_spec("home", fed.now_ms))
    await fed.result(handle)

    assert await upserted(handle, SA_STATE) == ["PENDING_HANDOFF", "RUNNING", "SUCCEEDED"]
    assert await upserted(handle, SA_PEER) == [HOME]


async def test_a_rejected_job_says_so_in_its_state_and_reason(fed: Federation) -> None:
    spec = gpu_spec("tpu", fed.now_ms, device=DeviceRequest(type="tpu", variant="v5e", count=4))
    handle = await fed.start(spec)
    st = await fed.result(handle)

    assert await upserted(handle, SA_STATE) == ["REJECTED"]
    assert await upserted(handle, SA_PEER) == []
    assert (await (await handle.describe()).memo())[MEMO_REASON] == st.reason


async def test_the_memo_holds_the_current_reason_for_the_job_list(fed: Federation) -> None:
    handle = await fed.queued(gpu_spec("memo", fed.now_ms))
    assert (await (await handle.describe()).memo())[MEMO_REASON] == QUEUED_REASON

    await fed.place(handle)
    st = await fed.result(handle)

    assert (await (await handle.describe()).memo())[MEMO_REASON] == st.reason == f"Succeeded on {PEER}"


async def test_the_web_ui_filter_finds_a_job_by_its_state_and_peer(dev_fed: Federation) -> None:
    """Visibility queries need the dev server: the Java test server does not implement
    ListWorkflowExecutions."""
    fed = dev_fed
    client = fed.env.client
    fed.fake.mirror = []

    handle = await fed.queued(gpu_spec("findable", fed.now_ms))
    assert await listed(client, f'WorkflowId = "{handle.id}" AND IrisState = "QUEUED_HANDOFF"') == [handle.id]

    await fed.place(handle)
    await wait_for(handle, lambda st: st.state is JobState.RUNNING, "ran")
    assert await listed(
        client, f'WorkflowId = "{handle.id}" AND IrisState = "RUNNING" AND IrisPeer = "{PEER}"'
    ) == [handle.id]
    fed.fake.set_remote_state(PEER, handle.id, ControllerJobState.SUCCEEDED)
    await fed.result(handle)
    assert await listed(client, f'WorkflowId = "{handle.id}" AND IrisState = "SUCCEEDED"') == [handle.id]
