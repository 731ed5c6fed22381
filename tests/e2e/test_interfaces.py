"""The interfaces people live in, exercised as a user would (docs/DESIGN.md, "Components",
"Interfaces")."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from stack import WAITS, Stack, wait_until

from iris.config import PROJECT_ROOT
from iris.jobs import JobState


async def test_run_streams_the_jobs_output_and_exits_with_its_outcome(stack: Stack) -> None:
    res = await stack.cli(
        "job", "run", "--job-name", "streamed", "--target-cluster", "cw-us-east-02a",
        "--", "sh", "-c", "echo one; echo two",
    )  # fmt: skip
    assert res.code == 0, res.stderr
    assert res.stdout.splitlines() == ["tester/streamed", "one", "two"]
    for state in ("CLASSIFYING", "QUEUED_HANDOFF", "PENDING_HANDOFF", "HANDED_OFF", "SUCCEEDED"):
        assert state in res.stderr, state


async def test_peers_table_and_list_peers_json(stack: Stack) -> None:
    table = await stack.cli("peers")
    assert table.code == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:2] == ["CLUSTER", "REACHABLE"]
    assert any(line.startswith("marin (home)") for line in lines)
    assert any("h100-us-east-02a" in line and "/16" in line for line in lines)
    assert any("h100-rno2a" in line and "/8" in line for line in lines)

    raw = await stack.cli("rpc", "controller", "list-peers")
    assert raw.code == 0, raw.stderr
    peers = json.loads(raw.stdout)["peers"]
    assert sorted(p["peer_id"] for p in peers) == sorted(stack.config.cluster_names)
    for p in peers:
        assert {"peer_id", "reachable", "last_contact_ms", "backends"} <= set(p)
        assert p["reachable"] is True
        for b in p["backends"]:
            assert {"backend_id", "advertised_attributes", "availability"} <= set(b)
    east = next(p for p in peers if p["peer_id"] == "cw-us-east-02a")
    assert east["backends"][0]["advertised_attributes"]["device-variant"] == ["h100"]
    # Its devices, and its CPU slots (CPU jobs are counted too: docs/DESIGN.md, "The ledger").
    totals = east["backends"][0]["availability"]["total_amounts"]
    assert totals["h100"] == 16 and set(totals) == {"h100", "cpu"} and totals["cpu"] > 0


async def test_list_filters_json_and_reason_column(stack: Stack) -> None:
    async with stack.holding():
        await _list_filters(stack)


async def _list_filters(stack: Stack) -> None:
    done = await stack.iris.submit(["true"], name="filter-done", target_cluster="cw-rno2a")
    waiting = await stack.iris.submit(["true"], name="filter-wait", **WAITS)
    await stack.iris.wait(done, timeout_s=60)

    async def both_indexed() -> bool:
        rows = {r.job_id: r for r in await stack.iris.list()}
        return (
            rows.get(done) is not None
            and rows[done].state == "SUCCEEDED"
            and rows.get(waiting) is not None
            and rows[waiting].state == "QUEUED_HANDOFF"
            and "h100" in rows[waiting].reason
        )

    await wait_until(both_indexed, timeout=60, what="both jobs in the visibility store")
    res = await stack.cli("job", "list", "--json", "--peer", "cw-rno2a", "--state", "SUCCEEDED")
    rows = json.loads(res.stdout)
    assert done in [r["job_id"] for r in rows]
    assert all(r["peer"] == "cw-rno2a" and r["state"] == "SUCCEEDED" for r in rows)
    assert {"job_id", "state", "peer", "band", "device", "user", "started_at", "reason"} <= set(rows[0])
    mine = json.loads((await stack.cli("job", "list", "--json", "--user", "root")).stdout)
    assert waiting in [r["job_id"] for r in mine]
    table = await stack.cli("job", "list", "--state", "QUEUED_HANDOFF")
    assert table.stdout.splitlines()[0].split()[-1] == "REASON"
    row = next(line for line in table.stdout.splitlines() if line.startswith(waiting))
    assert "h100" in row
    await stack.iris.cancel(waiting)
    await stack.iris.wait(waiting, timeout_s=30)


async def test_describe_shows_classification_tasks_handoffs_and_log_tail(stack: Stack) -> None:
    job_id = await stack.iris.submit(
        ["sh", "-c", "echo tail-line"], name="described", device_type="h100", gpu_count=4, replicas=2
    )
    final = await stack.iris.wait(job_id, timeout_s=60)
    assert final.state is JobState.SUCCEEDED, final.reason
    res = await stack.cli("job", "describe", job_id)
    out = res.stdout
    assert "Classification: queue" in out
    assert "Handoffs:       1" in out
    assert "replica 0: SUCCEEDED exit 0 slots" in out and "replica 1: SUCCEEDED" in out
    assert "promoted to" in out
    assert "Log tail:" in out and "tail-line" in out
    as_json = json.loads((await stack.cli("job", "describe", "--json", job_id)).stdout)
    assert as_json["handoff_attempts"] == 1 and len(as_json["tasks"]) == 2


async def test_sdk_example_runs_against_the_stack(stack: Stack) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(PROJECT_ROOT / "examples" / "sdk_example.py"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=stack.cli_env(),
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 180)
    text = out.decode()
    assert proc.returncode == 0, text + err.decode()
    assert "SUCCEEDED on cw-" in text
    assert "hello from the SDK" in text
    assert "cancel won" in text
    assert "listed 2 of my 2 jobs" in text


async def test_standard_temporal_env_config_overrides_the_federation_file(
    stack: Stack, tmp_path: Path
) -> None:
    cfg = stack.config.model_copy(deep=True)
    good = cfg.temporal.address
    cfg.temporal.address = "127.0.0.1:1"  # nothing listens there
    path = tmp_path / "wrong-temporal.json"
    path.write_text(cfg.model_dump_json())
    env = {**stack.cli_env(), "IRIS_CONFIG": str(path), "TEMPORAL_ADDRESS": good}
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "iris"), "job", "list",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert out.decode().startswith("JOB ID")


async def test_help_documents_exit_codes_and_completion() -> None:
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "iris"), "--help",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    out, _ = await proc.communicate()
    text = out.decode()
    assert "Exit codes" in text and "--install-completion" in text
    for command in ("job", "dev", "worker", "peers", "rpc", "ops", "keys"):
        assert command in text


async def test_shell_completion_completes_commands() -> None:
    iris = str(Path(sys.executable).parent / "iris")
    # Typer detects the shell from the calling process tree, as when a user runs it from bash; a
    # test process whose ancestors hold no shell (a detached CI job) gets "Shell not supported".
    # (The trailing command keeps bash from exec-ing iris in its place.)
    script = await asyncio.create_subprocess_exec(
        "bash", "-c", f'"{iris}" --show-completion; exit $?', stdout=asyncio.subprocess.PIPE
    )
    out, _ = await script.communicate()
    assert "_iris_completion" in out.decode()
    env = {**os.environ, "_IRIS_COMPLETE": "complete_bash", "COMP_WORDS": "iris jo", "COMP_CWORD": "1"}
    words = await asyncio.create_subprocess_exec(iris, stdout=asyncio.subprocess.PIPE, env=env)
    out, _ = await words.communicate()
    assert out.decode().split() == ["job"]
