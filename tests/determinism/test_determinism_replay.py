"""Determinism (docs/DESIGN.md, "Determinism check"): every committed history replays against the
current workflow code.

The histories under ``histories/`` were recorded on the real stack by
``uv run python -m scripts.record_histories``; a change to workflows/ that breaks one of them would
break every run in flight at deploy time. Regenerate them (one command) when the change is meant.

``v1-*.json`` were recorded before ``LOCAL_STEPS_PATCH`` (issue 9: store steps as local
activities, upserts only on change): runs started then take the unpatched branches, and these keep
those branches replayable for as long as the code carries them. ``v2-*.json`` were recorded before
``BASELINE_PATCH`` (issue 31: one marker per run), each patch asked on its own; the unprefixed ones
with it. ``v3-*.json`` were recorded with the baseline before a later patch changed their path
(``LAUNCH_FIRST_PATCH``: a bundle staged only when the launch finds it missing). ``v4-*.json`` were
recorded with ``BASELINE_PATCH`` (and ``LAUNCH_FIRST_PATCH`` where a bundle was handed off) before
``BASELINE_2027_PATCH`` (one activity admits a new job). ``v5-*.json`` were recorded with that, before
``BASELINE_2027_02_PATCH`` (the promotion CAS a local activity); the unprefixed ones with that. The
recorder never overwrites a prefixed one.

They were recorded without payload encryption, and replay with the worker's converter holding a
payload key ring (docs/SECURITY.md, "Payload encryption"): payloads without the codec's encoding
pass through it, so histories from before encryption keep replaying.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from pathlib import Path

import history_files
import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from cli.ops import replay_histories, workflow_type_of
from iris import contract
from iris.payloadcodec import Keyring
from iris.temporal import data_converter
from workflows.job import (
    ATTEMPTS_PATCH,
    AUTH_PATCH,
    BASELINE_2027_02_PATCH,
    BASELINE_2027_PATCH,
    BASELINE_PATCH,
    BUNDLE_PATCH,
    EARLIER_ATTEMPT_PATCH,
    FEED_PATCH,
    HOME_LEDGER_PATCH,
    LAUNCH_FIRST_PATCH,
    LOCAL_CONFIRM_PATCH,
    LOCAL_STEPS_PATCH,
    PARK_PATCH,
    PREEMPT_PATCH,
    REASON_PATCH,
    REQUEUE_PATCH,
    SIGNALS_PATCH,
    SIZE_PATCH,
    SUBMISSION_PATCH,
    TERMINAL_LAUNCH_PATCH,
    TIMERS_PATCH,
    JobWorkflow,
)
from workflows.placement import PlacementManager
from workflows.runner import workflow_runner
from workflows.watch import PeerWatch

# The main paths (docs/DESIGN.md, "Job states") the recorder drives; each must stay covered.
REQUIRED = {
    "local",
    "queued_handed_off",
    "cancelled_while_queued",
    "cancelled_while_running",
    "rejected",
    "parked_missing_artifact_cancelled",
    "parked_replayed",
    "deadline_unschedulable",
    "placement_manager",
    "peer_watch",
}
# Paths added later, each behind its own patch: the history must show the patched path was taken.
PATCHED_PATHS = {
    "bundled_handed_off": BUNDLE_PATCH,
    "launch_reply_lost": TERMINAL_LAUNCH_PATCH,
    # Issue 15: numbered attempts (a failed attempt retried; every launch reply lost, reconciled),
    # and a local job's home capacity taken through the ledger.
    "failure_retried": ATTEMPTS_PATCH,
    "launch_replies_all_lost": ATTEMPTS_PATCH,
    "local_through_the_ledger": HOME_LEDGER_PATCH,
    # A pinned job's attempt that succeeded on a peer while it was lost is the result (no re-run).
    "earlier_attempt_succeeded": EARLIER_ATTEMPT_PATCH,
    # Issue 16: a signed submission whose bare cancel signal is ignored; an unsigned start rejected.
    "unsigned_cancel_ignored": AUTH_PATCH,
    "unsigned_submission_rejected": AUTH_PATCH,
    # Issue 17: a running job followed through its cluster's watcher's signals, not a poller.
    "followed_by_watcher": FEED_PATCH,
    # Issue 18: the tick's explain_reason {reason, code}, and IrisReason upserted per change of code
    # (a job that waits for capacity and is cancelled; one whose pinned peer is down, then runs).
    "explained_then_cancelled": REASON_PATCH,
    "explained_then_run": REASON_PATCH,
    # Issue 19: a batch job preempted on its peer for an interactive one, queued again (Preempted)
    # as its second attempt, which succeeds.
    "preempted_requeued": PREEMPT_PATCH,
    # Issue 25: the handoff's retries and a park's probes on the configured schedule (the test
    # stack's short one): a launch whose answer was cut, parked with the outcome unknown, probed,
    # then adopted when its cluster answers.
    "launch_unanswered_adopted": TIMERS_PATCH,
    # Issue 26: a forged expire (no deadline) and a forged place (another zone, preemptible) to a
    # queued job, both recorded and ignored; a forged SUCCEEDED for a running attempt's nonce,
    # read back from its cluster and ignored (the job then ends as it would have).
    "forged_place_and_expire_ignored": SIGNALS_PATCH,
    "forged_observe_ignored": SIGNALS_PATCH,
    # Issue 26: a raw start with `{}`, and eve's signed spec under another user's job id: REJECTED.
    "malformed_start_rejected": SUBMISSION_PATCH,
    "foreign_name_rejected": SUBMISSION_PATCH,
    # Issue 27: 32 H100 where the largest backend has 16, REJECTED at classification (TooLarge); a
    # job parked on a missing artifact frees its reservation, and its replay in place takes it again
    # through the CAS, or (another job took it meanwhile) waits in the queue and then runs.
    "too_large_rejected": SIZE_PATCH,
    "parked_released_retaken": PARK_PATCH,
    "parked_retake_requeued": PARK_PATCH,
    # Issue 29: a batch job with --max-retries-preemption 0, preempted for an interactive job, queued
    # again without spending a budget, then succeeds (before the patch it ended FAILED, Preempted).
    "preempted_past_budget_requeued": REQUEUE_PATCH,
    # Issue 31: a watcher's reported end read back from its cluster by a local activity, in the
    # task that took the observation (a genuine end, and a forged SUCCEEDED the cluster denies).
    "end_confirmed_locally": LOCAL_CONFIRM_PATCH,
    "forged_observe_confirmed_locally": LOCAL_CONFIRM_PATCH,
}
# Runs recorded before LOCAL_STEPS_PATCH: the unpatched path of the same scenarios.
JOB_PATHS = REQUIRED - {"placement_manager", "peer_watch"}
REQUIRED_PRE_PATCH = {f"v1-{name}" for name in JOB_PATHS}
# Runs recorded before BASELINE_PATCH, each patch asked on its own: every job path, and every
# later path through its own patch. The unprefixed histories of the same paths take the baseline.
REQUIRED_PRE_BASELINE = {f"v2-{name}" for name in JOB_PATHS | set(PATCHED_PATHS)}
# Paths a patch after the baseline changed or added: recorded with the baseline and that patch
# (each asked on its own). Their runs begun before it: ``v3-<name>``, where the path existed.
AFTER_BASELINE = {
    # Issue 31: the launch goes first; the bundle is staged (BUILDING) only when the cluster lacks
    # it, and the launch sent again; a second job from the same workspace is launched at once.
    "bundled_handed_off": LAUNCH_FIRST_PATCH,
    "bundle_already_held": LAUNCH_FIRST_PATCH,
}
REQUIRED_BEFORE_LATER_PATCHES = {"v3-bundled_handed_off"}
# Runs begun with BASELINE_PATCH, before BASELINE_2027_PATCH: every job path, and the later ones.
REQUIRED_BEFORE_2027 = {f"v4-{name}" for name in JOB_PATHS | set(PATCHED_PATHS) | set(AFTER_BASELINE)}
# Runs begun with BASELINE_2027_PATCH, before BASELINE_2027_02_PATCH: every job path recorded then.
REQUIRED_BEFORE_2027_02 = {f"v5-{name}" for name in JOB_PATHS | set(PATCHED_PATHS) | set(AFTER_BASELINE)}
HISTORY_DIR = Path(__file__).parent / "histories"
STAGING = (contract.STAGE_BUNDLE, contract.LAUNCH_JOB)
REGENERATE = "regenerate with `uv run python -m scripts.record_histories` if the change is intended"


def committed_histories() -> list[Path]:
    return sorted(HISTORY_DIR.glob("*.json"))


def load(path: Path) -> WorkflowHistory:
    return history_files.load(path)


def test_every_main_path_has_a_committed_history() -> None:
    present = {p.stem for p in committed_histories()}
    assert present >= REQUIRED, f"missing histories {sorted(REQUIRED - present)} in {HISTORY_DIR}"
    missing = REQUIRED_PRE_PATCH - present
    assert not missing, f"missing pre-patch histories {sorted(missing)}: the unpatched path lost its check"
    missing = REQUIRED_PRE_BASELINE - present
    assert not missing, f"missing pre-baseline histories {sorted(missing)}: a patch's marker lost its check"
    missing = set(PATCHED_PATHS) - present
    assert not missing, f"missing histories {sorted(missing)}: a later path not recorded with the baseline"
    missing = (set(AFTER_BASELINE) | REQUIRED_BEFORE_LATER_PATCHES) - present
    assert not missing, f"missing histories {sorted(missing)}: a patch after the baseline lost its check"
    missing = REQUIRED_BEFORE_2027 - present
    assert not missing, f"missing histories {sorted(missing)}: a 2026-12 baseline run lost its check"
    missing = REQUIRED_BEFORE_2027_02 - present
    assert not missing, f"missing histories {sorted(missing)}: a 2027-01 baseline run lost its check"


def patches(path: Path) -> set[str]:
    """The patch ids a recorded history's workflow code took."""
    found = set()
    for event in json.loads(path.read_text())["events"]:
        marker = event.get("markerRecordedEventAttributes", {})
        if marker.get("markerName") == "core_patch":
            for payload in marker["details"]["patch-data"]["payloads"]:
                found.add(json.loads(base64.b64decode(payload["data"]))["id"])
    return found


def test_pre_patch_histories_take_the_unpatched_path() -> None:
    for path in HISTORY_DIR.glob("v1-*.json"):
        assert LOCAL_STEPS_PATCH not in patches(path), f"{path.name} was recorded with the patch"
    for name in JOB_PATHS:
        assert LOCAL_STEPS_PATCH in patches(HISTORY_DIR / f"v2-{name}.json"), f"{name} predates the patch"


def test_later_paths_are_recorded_through_their_patches() -> None:
    for name, patch in PATCHED_PATHS.items():
        assert patch in patches(HISTORY_DIR / f"v2-{name}.json"), f"v2-{name} did not take {patch}"
    # The older histories predate both: they keep the unpatched branches replayable.
    for name in JOB_PATHS:
        assert not patches(HISTORY_DIR / f"v2-{name}.json") & set(PATCHED_PATHS.values()), name


def test_pre_baseline_histories_ask_each_patch_and_new_ones_only_the_baseline() -> None:
    """BASELINE_PATCH: a run begun with it writes one patch marker, whatever path it takes (and
    LAUNCH_FIRST_PATCH, asked on its own after it). BASELINE_2027_PATCH and BASELINE_2027_02_PATCH:
    one marker each, whatever the path, and a run begun with the later never asks the earlier."""
    for path in HISTORY_DIR.glob("v[12]-*.json"):
        assert BASELINE_PATCH not in patches(path), f"{path.name} was recorded with the baseline"
    for name in JOB_PATHS | set(PATCHED_PATHS):
        later = {AFTER_BASELINE[name]} if name in AFTER_BASELINE else set()
        assert patches(HISTORY_DIR / f"v4-{name}.json") == {BASELINE_PATCH} | later, name
        assert patches(HISTORY_DIR / f"v5-{name}.json") == {BASELINE_2027_PATCH}, name
        assert patches(HISTORY_DIR / f"{name}.json") == {BASELINE_2027_02_PATCH}, name


def test_runs_begun_with_the_2027_baseline_are_admitted_by_one_activity() -> None:
    """BASELINE_2027_PATCH: the signature check and the capacity read are one activity; a run
    begun before it asked each (and replays so)."""
    checked = 0
    for name in sorted(JOB_PATHS | set(PATCHED_PATHS)):
        before = activities_of(HISTORY_DIR / f"v4-{name}.json")
        after = activities_of(HISTORY_DIR / f"v5-{name}.json")
        assert contract.ADMIT_SUBMISSION not in before, name
        if before[:1] != [contract.VERIFY_REQUEST]:
            continue  # refused before any check (a malformed start)
        checked += 1
        assert after[:1] == [contract.ADMIT_SUBMISSION], (name, after)
        # The submission's own check went into the admission (a cancel's or replay's still verifies).
        assert after.count(contract.VERIFY_REQUEST) == before.count(contract.VERIFY_REQUEST) - 1, name
        if before[1:2] == [contract.FETCH_REPORTS]:
            # And the classification's capacity read with it (a vetting's read again stays).
            fetched = (before.count(contract.FETCH_REPORTS), after.count(contract.FETCH_REPORTS))
            assert fetched[1] == fetched[0] - 1, (name, before, after)
    assert checked >= 10, checked


def test_runs_begun_with_the_2027_02_baseline_promote_by_a_local_activity() -> None:
    """BASELINE_2027_02_PATCH: the promotion CAS runs as a local activity in the task that took the
    placement, and the launch that follows is scheduled by that same task (no task of its own for
    the CAS's answer) but where a signal came in meanwhile; a run begun before it scheduled a
    promote_job per promotion (and replays so). Task counts are not compared: signals' timing
    varies them between recordings."""
    promoted = same_task = 0
    for name in sorted(JOB_PATHS | set(PATCHED_PATHS) | set(AFTER_BASELINE)):
        before = activities_of(HISTORY_DIR / f"v5-{name}.json")
        after = activities_of(HISTORY_DIR / f"{name}.json")
        assert contract.PROMOTE_JOB not in after, (name, after)
        cas = before.count(contract.PROMOTE_JOB)
        if not cas:
            continue
        promoted += 1
        # Everything else the run scheduled is the same (a CAS refused or retaken included).
        assert [a for a in before if a != contract.PROMOTE_JOB] == after, (name, before, after)
        assert local_activities_of(HISTORY_DIR / f"{name}.json").count(contract.PROMOTE_JOB) == cas, name
        same_task += promotions_launched_in_their_task(HISTORY_DIR / f"{name}.json")
    assert promoted >= 10, promoted
    assert same_task >= 10, same_task


def promotions_launched_in_their_task(path: Path) -> int:
    """Promotions (local promote_job markers) whose next scheduled activity is launch_job, scheduled
    in the same workflow task. Not every one: a signal that arrives while the task runs makes the
    server hand the rest to a new task (one recording in several)."""
    found = 0
    promoted_in: int | None = None
    for event in json.loads(path.read_text())["events"]:
        marker = event.get("markerRecordedEventAttributes", {})
        if marker.get("markerName") == "core_local_activity":
            data = json.loads(base64.b64decode(marker["details"]["data"]["payloads"][0]["data"]))
            if data["activity_type"] == contract.PROMOTE_JOB:
                promoted_in = int(marker["workflowTaskCompletedEventId"])
        scheduled = event.get("activityTaskScheduledEventAttributes")
        if scheduled is not None and promoted_in is not None:
            launch = scheduled["activityType"]["name"] == contract.LAUNCH_JOB
            found += launch and int(scheduled["workflowTaskCompletedEventId"]) == promoted_in
            promoted_in = None
    return found


def local_activities_of(path: Path) -> list[str]:
    """The local activity types a recorded history ran (their markers), in order."""
    found = []
    for event in json.loads(path.read_text())["events"]:
        marker = event.get("markerRecordedEventAttributes", {})
        if marker.get("markerName") == "core_local_activity":
            data = json.loads(base64.b64decode(marker["details"]["data"]["payloads"][0]["data"]))
            found.append(data["activity_type"])
    return found


def activities_of(path: Path) -> list[str]:
    """The activity types a recorded history scheduled, in order."""
    return [
        event["activityTaskScheduledEventAttributes"]["activityType"]["name"]
        for event in json.loads(path.read_text())["events"]
        if "activityTaskScheduledEventAttributes" in event
    ]


def test_paths_after_the_baseline_take_their_patch_and_older_runs_do_not() -> None:
    for name, patch in AFTER_BASELINE.items():
        assert patches(HISTORY_DIR / f"v4-{name}.json") == {BASELINE_PATCH, patch}, name
        # The 2027 baselines take it without asking.
        assert patches(HISTORY_DIR / f"v5-{name}.json") == {BASELINE_2027_PATCH}, name
        assert patches(HISTORY_DIR / f"{name}.json") == {BASELINE_2027_02_PATCH}, name
    for name in REQUIRED_BEFORE_LATER_PATCHES:
        assert patches(HISTORY_DIR / f"{name}.json") == {BASELINE_PATCH}, name
    # Before: staged, then launched. After: launched, found missing, staged, launched again; or
    # (the bundle already there) launched once, never staged.
    before = activities_of(HISTORY_DIR / "v3-bundled_handed_off.json")
    assert before.index(contract.STAGE_BUNDLE) < before.index(contract.LAUNCH_JOB)
    after = [a for a in activities_of(HISTORY_DIR / "bundled_handed_off.json") if a in STAGING]
    assert after == [contract.LAUNCH_JOB, contract.STAGE_BUNDLE, contract.LAUNCH_JOB]
    held = [a for a in activities_of(HISTORY_DIR / "bundle_already_held.json") if a in STAGING]
    assert held == [contract.LAUNCH_JOB]


@pytest.mark.parametrize("path", committed_histories(), ids=lambda p: p.stem)
async def test_committed_history_replays_against_the_current_code(path: Path) -> None:
    history = load(path)
    replayer = Replayer(
        workflows=[JobWorkflow, PlacementManager, PeerWatch],
        # A worker's converter with keys: the plain recorded payloads pass through its codec.
        data_converter=data_converter(Keyring.generate()),
        workflow_runner=workflow_runner(),
    )
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None, (
        f"{path.name} no longer replays: {result.replay_failure}; {REGENERATE}"
    )


async def test_the_ops_replay_reports_every_committed_history_clean() -> None:
    async def histories() -> AsyncIterator[WorkflowHistory]:
        for path in committed_histories():
            yield load(path)

    report = await replay_histories(histories(), "committed histories")
    assert report.ok, "\n".join(f.line() for f in report.failures)
    assert sum(report.replayed.values()) == len(committed_histories())
    # placement_manager.json, and the run recorded while the manager's input set the cap and the
    # interval (placement_manager_input_settings.json): its ticks carry no interval of their own.
    assert report.replayed["PlacementManager"] == 2


def test_histories_end_where_their_name_says() -> None:
    """The recorder drove each job to the end of its path (a broken recording is not a test)."""
    expected = {
        "local": "SUCCEEDED",
        "queued_handed_off": "SUCCEEDED",
        "cancelled_while_queued": "KILLED",
        "cancelled_while_running": "KILLED",
        "rejected": "REJECTED",
        "parked_missing_artifact_cancelled": "KILLED",
        "parked_replayed": "SUCCEEDED",
        "deadline_unschedulable": "UNSCHEDULABLE",
        "forged_place_and_expire_ignored": "KILLED",
        "forged_observe_ignored": "SUCCEEDED",
        "end_confirmed_locally": "SUCCEEDED",
        "forged_observe_confirmed_locally": "SUCCEEDED",
        "malformed_start_rejected": "REJECTED",
        "foreign_name_rejected": "REJECTED",
        "too_large_rejected": "REJECTED",
        "parked_released_retaken": "SUCCEEDED",
        "parked_retake_requeued": "SUCCEEDED",
    }
    for name, state in [(f"{v}{n}", s) for n, s in expected.items() for v in ("", "v2-", "v4-", "v5-")]:
        history = load(HISTORY_DIR / f"{name}.json")
        assert workflow_type_of(history) == "JobWorkflow"
        last = history.events[-1]
        assert last.HasField("workflow_execution_completed_event_attributes"), name
        payload = last.workflow_execution_completed_event_attributes.result.payloads[0]
        assert json.loads(payload.data)["state"] == state, name


async def test_a_history_the_code_did_not_produce_is_reported_nondeterministic() -> None:
    """The check can fail: the first activity of a recorded run renamed, as a code change would."""
    history = load(HISTORY_DIR / "local.json")
    for event in history.events:
        if event.HasField("activity_task_scheduled_event_attributes"):
            event.activity_task_scheduled_event_attributes.activity_type.name = "fetch_reports_v2"
            break

    async def one() -> AsyncIterator[WorkflowHistory]:
        yield history

    report = await replay_histories(one(), "drifted")
    assert not report.ok
    [failure] = report.failures
    assert failure.nondeterministic and failure.workflow_type == "JobWorkflow"
    assert failure.line().startswith(f"FAIL {history.workflow_id} (run ")
