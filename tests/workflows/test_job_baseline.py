"""One patch marker per run (BASELINE_PATCH; docs/DESIGN.md, "Determinism check": "One marker per
run"; issue 31). Each ``workflow.patched`` that answers yes writes a marker and an upsert of
``TemporalChangeVersion`` that the server indexes; a run begun with the baseline takes every patch
before it through its one marker, on every path, the patches asked late included (the bundle's,
the home ledger's). Runs begun before it replay their own markers (tests/determinism, ``v2-*``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from job_doubles import BUNDLE, Federation, cpu_spec, gpu_spec, wait_for
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import WorkflowHandle

import workflows.job.steps.common as common
from iris import contract
from iris.jobs import JobState, JobStatus
from workflows.job import BASELINE_PATCH, LAUNCH_FIRST_PATCH, JobWorkflow


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
    """The bundle's own patch (BUNDLE_PATCH) comes through the baseline; LAUNCH_FIRST_PATCH, added
    after it, is asked on its own where the bundle is handed off."""
    handle = await fed.queued(
        gpu_spec("baseline-bundled", fed.now_ms, bundle=BUNDLE, artifacts=["s3://ckpt/x"])
    )
    await fed.place(handle)
    st = await fed.result(handle)
    assert st.state is JobState.SUCCEEDED, st.reason
    assert contract.STAGE_BUNDLE in fed.fake.calls  # staged: BUNDLE_PATCH taken
    events = await history(handle)
    assert patch_ids(events) == [BASELINE_PATCH, LAUNCH_FIRST_PATCH]
    assert change_version_upserts(events) == 2
    # The marker stands in the first task's commands, first of them.
    marker = next(i for i, e in enumerate(events) if e.HasField("marker_recorded_event_attributes"))
    assert marker == first_task_end(events) + 1


async def test_a_job_run_at_home_through_the_ledger_writes_one_patch_marker(fed: Federation) -> None:
    handle = await fed.start(cpu_spec("baseline-home", fed.now_ms))
    st = await fed.result(handle)
    assert st.state is JobState.SUCCEEDED, st.reason
    assert fed.fake.promotions, "home capacity not taken through the CAS: HOME_LEDGER_PATCH not taken"
    events = await history(handle)
    assert patch_ids(events) == [BASELINE_PATCH]
    assert change_version_upserts(events) == 1


async def test_a_continued_run_writes_one_patch_marker_too(
    fed: Federation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each run of a job asks the baseline in its first task: a continued run writes one marker
    and one upsert of its own (before the baseline, it asked its ten first-task patches again)."""
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
    assert patch_ids(events) == [BASELINE_PATCH]
    assert change_version_upserts(events) == 1
    assert patch_ids(await history(first)) == [BASELINE_PATCH]
