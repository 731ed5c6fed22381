"""`iris ops check-determinism` end to end: live histories of the session's Temporal replayed by the CLI."""

from __future__ import annotations

import uuid
from datetime import timedelta

from stack import Stack, wait_until
from temporalio import workflow
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.workflowservice.v1 import DeleteWorkflowExecutionRequest
from temporalio.worker import Worker

from iris.jobs import JobSpec, JobState, JobStatus


@workflow.defn(name="JobWorkflow", sandboxed=False)
class DriftedJobWorkflow:
    """What an incompatible deploy of JobWorkflow would have recorded: a timer where the code starts."""

    @workflow.run
    async def run(self, spec: JobSpec) -> JobStatus:
        await workflow.sleep(timedelta(milliseconds=10))
        return JobStatus(job_id=spec.job_id, state=JobState.SUCCEEDED)


async def test_live_histories_of_the_session_replay_clean(stack: Stack) -> None:
    job_id = await stack.iris.submit(["echo", "replay me"], name=f"determinism-{uuid.uuid4().hex[:6]}")
    assert (await stack.iris.wait(job_id, timeout_s=60)).state is JobState.SUCCEEDED
    res = await stack.cli("ops", "check-determinism", timeout=300)
    assert res.code == 0, res.stdout + res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("replayed ") and ": 0 failed" in lines[0], lines[0]
    assert "JobWorkflow" in lines[0]
    # A query narrows the set; the placement manager replays too.
    one = await stack.cli("ops", "check-determinism", "--query", f"WorkflowId = '{job_id}'")
    assert one.code == 0 and one.stdout.startswith("replayed 1 execution(s) (JobWorkflow 1)"), one.stdout
    manager = await stack.cli("ops", "check-determinism", "--query", "WorkflowType = 'PlacementManager'")
    assert manager.code == 0 and "PlacementManager" in manager.stdout, manager.stdout


async def test_a_nondeterministic_live_history_fails_the_check(stack: Stack) -> None:
    task_queue = f"iris-drift-{uuid.uuid4().hex[:8]}"
    job_id = f"determinism/drift-{uuid.uuid4().hex[:8]}"
    spec = JobSpec(job_id=job_id, name="drift", user="ops@example.com", command=["true"])
    async with Worker(stack.client, task_queue=task_queue, workflows=[DriftedJobWorkflow]):
        await stack.client.execute_workflow(DriftedJobWorkflow.run, spec, id=job_id, task_queue=task_queue)
    try:
        res = await stack.cli("ops", "check-determinism", "--query", f"WorkflowId = '{job_id}'")
        assert res.code == 1, res.stdout + res.stderr
        summary, *failures = res.stdout.strip().splitlines()
        assert summary.startswith("replayed 1 execution(s) (JobWorkflow 1)") and ": 1 failed" in summary
        assert len(failures) == 1 and failures[0].startswith(f"FAIL {job_id} (run ")
        assert "nondeterministic" in failures[0]
    finally:
        await stack.client.workflow_service.delete_workflow_execution(
            DeleteWorkflowExecutionRequest(
                namespace=stack.client.namespace, workflow_execution=WorkflowExecution(workflow_id=job_id)
            )
        )

        async def gone() -> bool:
            return (await stack.client.count_workflows(f"WorkflowId = '{job_id}'")).count == 0

        # Deletion is asynchronous in the server (history, then visibility); on a freshly started,
        # busy dev server it has taken over 30 s.
        await wait_until(gone, timeout=180, interval=0.5, what="the drifted execution to be deleted")


async def test_an_invalid_query_is_one_line_and_exit_2(stack: Stack) -> None:
    res = await stack.cli("ops", "check-determinism", "--query", "NoSuchField ===")
    assert res.code == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: invalid query"), lines
