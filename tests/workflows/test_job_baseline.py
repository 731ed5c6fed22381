"""One patch marker per run (BASELINE_2027_02_PATCH, before it BASELINE_2027_PATCH and
BASELINE_PATCH; docs/DESIGN.md, "Determinism check": "One marker per run"; issue 31).

Each ``workflow.patched`` that answers yes writes a marker and an upsert of
``TemporalChangeVersion`` that the server indexes; a run begun with the baseline takes every patch
before it through its one marker, on every path, the patches asked late included (the bundle's,
the home ledger's). Runs begun before it replay their own markers (tests/determinism, ``v2-*``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from job_doubles import BUNDLE, Federation, cpu_spec, gpu_spec, start_job, wait_for
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import WorkflowHandle

import workflows.job.steps.common as common
from iris import contract
from iris.jobs import JobState, JobStatus
from workflows.job import BASELINE_2027_02_PATCH, JobWorkflow


async def history(handle: WorkflowHandle[Any, JobStatus]) -> list[HistoryEvent]:
    return [e async for e in handle.fetch_history_events()]


def patch_ids(events: list[HistoryEvent]) -> list[str]:
    return [
        json.loads(e.marker_recorded_event_attributes.details["patch-data"].payloads[0].data)["id"]
        for e in events
        if e.HasField("marker_recorded_event_attributes")
        and e.marker_recorded_event_attributes.marker_name == "core_patch"
    ]


def change_version_upserts(events: list[HistoryEvent]) -> int:
    upserts = [
        e.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields
        for e in events
        if e.HasField("upsert_workflow_search_attributes_event_attributes")
    ]
    return sum(1 for fields in upserts if "TemporalChangeVersion" in fields)


def first_task_end(events: list[HistoryEvent]) -> int:
    return next(i for i, e in enumerate(events) if e.HasField("workflow_task_completed_event_attributes"))


async def test_a_handed_off_bundled_job_writes_the_baseline_and_one_later_marker(fed: Federation) -> None:
    """The bundle's own patches (BUNDLE_PATCH, and LAUNCH_FIRST_PATCH, asked on its own by a run
    begun with the 2026-12 baseline) come through the 2027 baselines."""
    handle = await fed.queued(
        gpu_spec("baseline-bundled", fed.now_ms, bundle=BUNDLE, artifacts=["s3://ckpt/x"])
    )
    await fed.place(handle)
    st = await fed.result(handle)
    assert st.state is JobState.SUCCEEDED, st.reason
    assert contract.STAGE_BUNDLE in fed.fake.calls  # staged: BUNDLE_PATCH taken
    events = await history(handle)
    assert patch_ids(events) == [BASELINE_2027_02_PATCH]
    assert change_version_upserts(events) == 1
    # The marker stands in the first task's commands, first of them.
    marker = next(i for i, e in enumerate(events) if e.HasField("marker_recorded_event_attributes"))
    assert marker == first_task_end(events) + 1


async def test_a_job_run_at_home_through_the_ledger_writes_one_patch_marker(fed: Federation) -> None:
    handle = await fed.start(cpu_spec("baseline-home", fed.now_ms))
    st = await fed.result(handle)
    assert st.state is JobState.SUCCEEDED, st.reason
    assert fed.fake.promotions, "home capacity not taken through the CAS: HOME_LEDGER_PATCH not taken"
    events = await history(handle)
    assert patch_ids(events) == [BASELINE_2027_02_PATCH]
    assert change_version_upserts(events) == 1


async def test_a_continued_run_writes_one_patch_marker_too(
    dev_fed: Federation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each run of a job asks the baseline in its first task: a continued run writes one marker
    and one upsert of its own (before the baseline, it asked its ten first-task patches again).

    On the dev server, not the Java test server: there, a signal that lands while the run's last
    task continues it as new can leave a second task on the closed run ("workflow execution already
    completed"); the query behind it is never answered ("query deadline exceeded") and the server
    stops skipping time for every later test. It did so twice in 26 runs with both cores busy; the
    dev server passed 40 of 40 the same way."""
    fed = dev_fed
    # The workflows package is imported once, outside the sandbox, so the run reads this value.
    monkeypatch.setattr(common, "CONTINUE_AFTER_EVENTS", 40)
    spec = gpu_spec("baseline-continued", fed.now_ms)
    first = await fed.queued(spec)
    latest = fed.env.client.get_workflow_handle_for(JobWorkflow.run, spec.job_id)
    for i in range(30):
        await latest.signal(JobWorkflow.explain, f"cw-a full: {i} jobs ahead")
        if (await latest.describe()).run_id != first.result_run_id:
            break
    st = await wait_for(latest, lambda s: s.reason.startswith("cw-a full"), "took a reason")
    assert st.state is JobState.QUEUED_HANDOFF
    continued = (await latest.describe()).run_id
    assert continued != first.result_run_id, "the run never continued as new"
    events = await history(fed.env.client.get_workflow_handle(spec.job_id, run_id=continued))
    assert patch_ids(events) == [BASELINE_2027_02_PATCH]
    assert change_version_upserts(events) == 1
    assert patch_ids(await history(first)) == [BASELINE_2027_02_PATCH]


async def test_a_new_job_is_admitted_by_one_activity_and_starts_with_its_memo(fed: Federation) -> None:
    """The 2027-01 baseline: the signature check and the capacity read are one activity
    (admit_submission), and the memo the client starts the run with is not written again."""
    handle = await fed.queued(gpu_spec("baseline-admitted", fed.now_ms))
    events = await history(handle)
    scheduled = [
        e.activity_task_scheduled_event_attributes.activity_type.name
        for e in events
        if e.HasField("activity_task_scheduled_event_attributes")
    ]
    assert scheduled == [contract.ADMIT_SUBMISSION], scheduled
    assert fed.fake.calls[:2] == [contract.VERIFY_REQUEST, contract.FETCH_REPORTS]
    memos = [
        e.workflow_properties_modified_event_attributes.upserted_memo.fields[contract.MEMO_REASON].data
        for e in events
        if e.HasField("workflow_properties_modified_event_attributes")
    ]
    assert all(b"Classifying" not in m for m in memos), memos


async def test_a_start_without_the_memo_gets_it_written(fed: Federation) -> None:
    """A client that predates the start memo: the run writes the first reason itself."""
    spec = gpu_spec("baseline-no-memo", fed.now_ms)
    handle = await start_job(fed.env, spec, fed.task_queue, memo=False)
    fed.handles.append(handle)
    await wait_for(handle, lambda s: s.state is JobState.QUEUED_HANDOFF, "queued")
    memos = [
        e.workflow_properties_modified_event_attributes.upserted_memo.fields[contract.MEMO_REASON].data
        for e in await history(handle)
        if e.HasField("workflow_properties_modified_event_attributes")
    ]
    assert b"Classifying" in memos[0], memos
