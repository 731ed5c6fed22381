"""Attempts through the CLI on the real stack (docs/DESIGN.md, "Attempts"): a job that fails once
runs again within --max-retries-failure, `iris job run` streams both attempts' output, `describe`
lists them and `logs` reads each one's relayed log; a --timeout ends a job FAILED, never retried."""

from __future__ import annotations

import json
import secrets

from stack import Stack

from iris.jobs import AttemptEnd, JobState


async def test_a_failed_attempt_runs_again_and_each_attempts_output_is_kept(stack: Stack) -> None:
    # In the stack's shared directory: each attempt runs in a sandbox of its own (tmp_path is out
    # of its sight), maybe as another pool uid.
    marker = stack.shared_dir / f"tried-once-{secrets.token_hex(4)}"
    script = f"if [ -e {marker} ]; then echo second; else touch {marker}; echo first; exit 3; fi"
    name = f"retried-{secrets.token_hex(3)}"
    job_id = f"tester/{name}"
    run = await stack.cli(
        "job", "run", "--job-name", name, "--device-type", "h100", "--gpu-count", "1",
        "--max-retries-failure", "1", "--timeout", "10m", "--", "sh", "-c", script,
    )  # fmt: skip
    assert run.code == 0, run.stderr
    assert run.stdout.splitlines() == [job_id, "first", "second"], run.stdout
    assert "attempt 1 ended (FAILED)" in run.stderr

    described = await stack.cli("job", "describe", job_id)
    lines = described.stdout.splitlines()
    at = lines.index("Attempts:")
    rows = [line.split() for line in lines[at + 2 : at + 4]]
    assert [(r[0], r[4], r[5]) for r in rows] == [("1", "FAILED", "3"), ("2", "SUCCEEDED", "0")], lines
    assert "Log tail (attempt 2):" in lines and "  second" in lines

    as_json = json.loads((await stack.cli("job", "describe", "--json", job_id)).stdout)
    assert [a["end"] for a in as_json["attempts"]] == [AttemptEnd.FAILED.value, AttemptEnd.SUCCEEDED.value]
    assert (as_json["spec"]["max_retries_failure"], as_json["spec"]["timeout_s"]) == (1, 600.0)

    assert (await stack.cli("job", "logs", job_id)).stdout == "second\n"
    assert (await stack.cli("job", "logs", "--attempt", "1", job_id)).stdout == "first\n"


async def test_a_job_past_its_timeout_fails_and_is_not_retried(stack: Stack) -> None:
    name = f"timed-{secrets.token_hex(3)}"
    run = await stack.cli(
        "job", "run", "--no-wait", "--job-name", name, "--max-retries-failure", "2", "--timeout", "1s",
        "--", "sleep", "60",
    )  # fmt: skip
    assert run.code == 0, run.stderr
    final = await stack.iris.wait(f"tester/{name}", timeout_s=60)
    assert final.state is JobState.FAILED
    assert [a.end for a in final.attempts] == [AttemptEnd.TIMEOUT.value], final.attempts
    assert "timeout" in final.reason
