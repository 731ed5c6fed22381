"""The walking skeleton end to end: CLI → Temporal → JobWorkflow → real controllers → back.

Every classification outcome (docs/DESIGN.md, "Classification"), real exit codes, logs,
cancellation and bad input.
"""

from __future__ import annotations

import json

import httpx
from stack import WAITS_ARGS, Stack, wait_until

from iris.controller.client import ControllerClient
from iris.controller.errors import NotFound
from iris.jobs import JobState


async def count_jobs(stack: Stack) -> int:
    return len(await stack.iris.list())


async def on_cluster(stack: Stack, cluster: str, job_id: str) -> bool:
    async with ControllerClient.for_cluster(stack.config, cluster) as ctl:
        try:
            await ctl.status(job_id)
        except NotFound:
            return False
    return True


async def test_local_job_runs_at_home_and_its_logs_are_served(stack: Stack) -> None:
    res = await stack.cli("job", "run", "--job-name", "hello", "--", "echo", "hello")
    assert res.code == 0, res.stderr
    job_id = res.stdout.strip().splitlines()[0]
    assert job_id == "tester/hello"
    assert "SUCCEEDED" in res.stderr
    st = await stack.iris.describe(job_id)
    assert st.state is JobState.SUCCEEDED
    assert st.cluster == stack.config.home
    assert st.disposition == "local"
    assert st.exit_code == 0
    logs = await stack.cli("job", "logs", job_id)
    assert logs.code == 0
    assert logs.stdout.strip() == "hello"
    assert await on_cluster(stack, "marin", job_id)


async def test_pinned_job_runs_on_that_peer_and_describe_says_so(stack: Stack) -> None:
    res = await stack.cli(
        "job", "run", "--target-cluster", "cw-us-east-02a", "--device-type", "h100", "--gpu-count", "8",
        "--job-name", "pinned-42", "--", "python", "-c", "print(42)",
    )  # fmt: skip
    assert res.code == 0, res.stderr
    job_id = "tester/pinned-42"
    desc = await stack.cli("job", "describe", job_id)
    assert desc.code == 0
    assert "cw-us-east-02a" in desc.stdout
    assert "SUCCEEDED" in desc.stdout
    st = await stack.iris.describe(job_id)
    assert st.cluster == "cw-us-east-02a"
    assert [e.state for e in st.events].count(JobState.HANDED_OFF) == 1
    assert (await stack.iris.logs(job_id)).data.strip() == "42"
    # It ran on the pinned peer only.
    assert await on_cluster(stack, "cw-us-east-02a", job_id)
    assert not await on_cluster(stack, "cw-rno2a", job_id)
    assert not await on_cluster(stack, "marin", job_id)


async def test_pin_queues_even_when_home_could_run_it(stack: Stack) -> None:
    res = await stack.cli(
        "job", "run", "--target-cluster", "cw-rno2a", "--job-name", "cpu-pinned", "--", "true"
    )
    assert res.code == 0, res.stderr
    st = await stack.iris.describe("tester/cpu-pinned")
    assert st.disposition == "queue"
    assert st.cluster == "cw-rno2a"
    assert st.state is JobState.SUCCEEDED


async def test_failing_command_fails_the_job_with_its_exit_code(stack: Stack) -> None:
    res = await stack.cli("job", "run", "--job-name", "exit3", "--", "sh", "-c", "echo oops >&2; exit 3")
    assert res.code == 1
    st = await stack.iris.describe("tester/exit3")
    assert st.state is JobState.FAILED
    assert st.exit_code == 3
    assert "oops" in (await stack.iris.logs("tester/exit3")).data


async def test_shape_nobody_can_host_is_rejected_at_submit_and_starts_nothing(stack: Stack) -> None:
    before = await count_jobs(stack)
    res = await stack.cli("job", "run", "--device-type", "tpu-v9", "--", "true")
    assert res.code == 2
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "rejected" in lines[0] and "tpu" in lines[0]
    assert await count_jobs(stack) == before


async def test_unknown_pin_is_an_error_and_starts_nothing(stack: Stack) -> None:
    before = await count_jobs(stack)
    res = await stack.cli("job", "run", "--target-cluster", "nowhere-1", "--", "true")
    assert res.code == 2
    assert len(res.stderr.strip().splitlines()) == 1
    assert "unknown cluster 'nowhere-1'" in res.stderr
    assert await count_jobs(stack) == before


async def test_bad_input_is_one_line_and_starts_nothing(stack: Stack) -> None:
    before = await count_jobs(stack)
    cases = [
        ("job", "run", "--gpu-count", "-1", "--device-type", "h100", "--", "true"),
        ("job", "run", "--priority", "urgent", "--", "true"),
        ("job", "run", "--job-name", "bad name!", "--", "true"),
        ("job", "run", "--artifact", "ftp://x/y", "--", "true"),
        ("job", "run", "--env", "NOEQUALS", "--", "true"),
        ("job", "run", "--scheduling-timeout", "soon", "--", "true"),
    ]
    for args in cases:
        res = await stack.cli(*args)
        assert res.code == 2, (args, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1, (args, res.stderr)
        assert res.stderr.startswith("error: "), res.stderr
    assert await count_jobs(stack) == before


async def test_duplicate_job_id_is_refused(stack: Stack) -> None:
    first = await stack.cli("job", "run", "--no-wait", "--job-name", "twice", "--", "true")
    assert first.code == 0, first.stderr
    second = await stack.cli("job", "run", "--no-wait", "--job-name", "twice", "--", "true")
    assert second.code == 2
    assert "already exists" in second.stderr


async def test_unpinned_gpu_job_waits_queued_with_a_reason_and_cancels_before_handoff(stack: Stack) -> None:
    # 2 replicas × 8 H100 on one backend: only cw-us-east-02a's 16 hold it, and one is held.
    async with stack.holding():
        await _waits_then_cancelled(stack)


async def _waits_then_cancelled(stack: Stack) -> None:
    res = await stack.cli("job", "run", "--no-wait", *WAITS_ARGS, "--job-name", "queued", "--", "true")
    assert res.code == 0, res.stderr
    job_id = "tester/queued"

    async def explained() -> bool:
        st = await stack.iris.describe(job_id)
        return st.state is JobState.QUEUED_HANDOFF and "h100" in st.reason

    await wait_until(explained, what="QUEUED_HANDOFF with the tick's explanation")
    st = await stack.iris.describe(job_id)
    assert st.disposition == "queue"
    assert st.events[-1].message == "Queued for a federation peer to report free capacity"
    assert "16" in st.reason  # what it needs, said per peer

    async def listed() -> bool:
        return job_id in (await stack.cli("job", "list", "--state", "QUEUED_HANDOFF")).stdout

    await wait_until(listed, what="the job in `iris job list --state QUEUED_HANDOFF`")
    cancel = await stack.cli("job", "cancel", job_id)
    assert cancel.code == 0, cancel.stderr
    assert "cancel won" in cancel.stdout
    final = await stack.iris.wait(job_id, timeout_s=30)
    assert final.state is JobState.KILLED
    assert final.reason == "Cancelled before handoff"
    for cluster in stack.config.cluster_names:
        assert not await on_cluster(stack, cluster, job_id)


async def test_cancel_while_running_terminates_the_process_on_the_peer(stack: Stack) -> None:
    res = await stack.cli(
        "job", "run", "--no-wait", "--target-cluster", "cw-us-east-02a", "--job-name", "sleeper",
        "--", "sleep", "300",
    )  # fmt: skip
    assert res.code == 0, res.stderr
    job_id = "tester/sleeper"

    async def running() -> bool:
        return (await stack.iris.describe(job_id)).state is JobState.RUNNING

    await wait_until(running, what="RUNNING")
    cancel = await stack.cli("job", "cancel", job_id)
    assert "cancel lost" in cancel.stdout  # already handed off: termination goes to the peer
    final = await stack.iris.wait(job_id, timeout_s=30)
    assert final.state is JobState.KILLED
    async with ControllerClient.for_cluster(stack.config, "cw-us-east-02a") as ctl:
        assert (await ctl.status(job_id)).state.value == "KILLED"


async def test_temporal_cancel_converges_on_the_same_path(stack: Stack) -> None:
    job_id = await stack.iris.submit(["sleep", "300"], name="temporal-cancel", target_cluster="cw-rno2a")

    async def running() -> bool:
        return (await stack.iris.describe(job_id)).state is JobState.RUNNING

    await wait_until(running, what="RUNNING")
    await stack.client.get_workflow_handle(job_id).cancel()
    final = await stack.iris.wait(job_id, timeout_s=30)
    assert final.state is JobState.KILLED
    async with ControllerClient.for_cluster(stack.config, "cw-rno2a") as ctl:
        assert (await ctl.status(job_id)).state.value == "KILLED"


async def test_list_and_describe_json(stack: Stack) -> None:
    job_id = await stack.iris.submit(["echo", "listed"], name="listed")
    await stack.iris.wait(job_id, timeout_s=60)

    async def visible() -> bool:
        rows = await stack.iris.list(state="SUCCEEDED")
        return any(r.job_id == job_id for r in rows)

    await wait_until(visible, what="visibility to catch up")
    res = await stack.cli("job", "list")
    assert res.code == 0
    assert res.stdout.splitlines()[0].split()[:3] == ["JOB", "ID", "STATE"]
    row = next(line for line in res.stdout.splitlines() if line.startswith(job_id))
    assert "SUCCEEDED" in row and "marin" in row
    desc = await stack.cli("job", "describe", "--json", job_id)
    assert json.loads(desc.stdout)["state"] == "SUCCEEDED"
    missing = await stack.cli("job", "describe", "tester/no-such-job")
    assert missing.code == 3
    assert "not found" in missing.stderr


async def test_search_attributes_follow_the_state(stack: Stack) -> None:
    job_id = await stack.iris.submit(["true"], name="sa", target_cluster="cw-us-east-02a")
    await stack.iris.wait(job_id, timeout_s=60)

    async def indexed() -> bool:
        rows = await stack.iris.list(peer="cw-us-east-02a", state="SUCCEEDED")
        return any(r.job_id == job_id for r in rows)

    await wait_until(indexed, what="IrisState/IrisPeer search attributes")
    desc = await stack.client.get_workflow_handle(job_id).describe()
    summary = await desc.static_summary()
    assert summary is not None and "cw-us-east-02a" in summary and "interactive" in summary


async def test_controller_health_answers(stack: Stack) -> None:
    async with httpx.AsyncClient(timeout=5) as http:
        for c in stack.config.clusters:
            assert (await http.get(f"{c.url}/v1/health")).status_code == 200
