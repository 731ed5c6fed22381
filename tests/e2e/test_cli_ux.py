"""The CLI as people type it (issue 18), on the real stack, `iris` run as a subprocess:

- a bare job name is the current user's job: `iris job describe hello` and `iris job cancel hello`
  work for the user who submitted `hello`; another user's bare `hello` is their own, not found;
- `iris job list --since/--limit/-o wide|json|yaml`, with reason codes and queue positions;
- a queued job's position among the jobs waiting for the same shape (`list` and `describe`);
- `iris job run --dry-run` starts nothing (the visibility count of JobWorkflow is unchanged, no
  bundle is stored) and names each peer's verdict; exit 2 for a job that would be rejected;
- `iris job run -f job.yaml`, flags overriding the file's values.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from datetime import UTC, datetime
from pathlib import Path

import yaml
from stack import VENV_BIN, CliResult, Stack, wait_until

from iris.bundle import home_key, pack
from iris.jobs import JobState
from iris.objectstore import open_store

TESTER = "tester@example.com"


async def iris(stack: Stack, *args: str, user: str = TESTER, cwd: Path | None = None) -> CliResult:
    """`iris ARGS...` as ``user`` (IRIS_USER), in ``cwd`` (default: an empty directory)."""
    if cwd is None:
        cwd = stack.data_dir / "empty-cwd"
        cwd.mkdir(exist_ok=True)
    proc = await asyncio.create_subprocess_exec(
        str(VENV_BIN / "iris"),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**stack.cli_env(), "IRIS_USER": user},
        cwd=cwd,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return CliResult(proc.returncode or 0, out.decode(), err.decode())


async def job_workflows_since(stack: Stack, since: str) -> set[str]:
    """The ids of the JobWorkflows started since ``since`` (the visibility store's time format). Not
    a count of them all: another test of the same stack may delete a run meanwhile, which leaves the
    store asynchronously (CI on 9247ecb counted one fewer after the dry runs than before them)."""
    query = f"WorkflowType = 'JobWorkflow' AND StartTime >= '{since}'"
    return {w.id async for w in stack.client.list_workflows(query)}


async def listed_after(stack: Stack, job_id: str) -> None:
    """Wait until visibility lists ``job_id``'s workflow."""

    async def listed() -> bool:
        return (await stack.client.count_workflows(f"WorkflowId = '{job_id}'")).count == 1

    await wait_until(listed, timeout=60, what=f"{job_id} in visibility")


def job_id_of(dry_run: CliResult) -> str:
    """The job id a dry run names on its first line (``Job:            <id> (dry run...)``)."""
    first = dry_run.stdout.splitlines()[0]
    assert first.startswith("Job:"), dry_run.stdout
    return first.split()[1]


async def state_of(stack: Stack, job_id: str) -> JobState:
    return (await stack.iris.describe(job_id)).state


async def test_a_bare_name_is_the_current_users_job(stack: Stack) -> None:
    name = f"hello-{secrets.token_hex(3)}"
    run = await iris(stack, "job", "run", "--no-wait", "--job-name", name, "--", "sleep", "120")
    assert run.code == 0, run.stderr
    assert run.stdout.strip() == f"tester/{name}"

    described = await iris(stack, "job", "describe", name)
    assert described.code == 0, described.stderr
    assert described.stdout.splitlines()[0] == f"Job:            tester/{name}"

    # alice's `hello` is alice/hello: not found, and tester's job is untouched.
    for command in ("describe", "cancel"):
        other = await iris(stack, "job", command, name, user="alice")
        assert other.code == 3, (command, other)
        assert other.stderr.strip() == f"error: job alice/{name} not found", other.stderr
    status = await stack.iris.describe(f"tester/{name}")
    assert not status.cancel_requested and not status.terminal

    cancelled = await iris(stack, "job", "cancel", name)
    assert cancelled.code == 0, cancelled.stderr
    assert cancelled.stdout.startswith(f"tester/{name}: cancel "), cancelled.stdout
    final = await stack.iris.wait(f"tester/{name}", timeout_s=60)
    assert final.state is JobState.KILLED


async def test_list_since_limit_and_output_formats(stack: Stack) -> None:
    names = [f"listed-{i}-{secrets.token_hex(3)}" for i in range(2)]
    for name in names:
        run = await iris(stack, "job", "run", "--job-name", name, "--", "true")
        assert run.code == 0, run.stderr
    newest = f"tester/{names[1]}"

    as_json = await iris(stack, "job", "list", "--since", "10m", "--limit", "1", "-o", "json")
    assert as_json.code == 0, as_json.stderr
    rows = json.loads(as_json.stdout)
    assert [r["job_id"] for r in rows] == [newest]
    assert {"reason_code", "position", "reason", "state"} <= set(rows[0])
    assert json.loads((await iris(stack, "job", "list", "--limit", "1", "--json")).stdout) == rows

    as_yaml = await iris(stack, "job", "list", "--limit", "2", "-o", "yaml")
    assert as_yaml.code == 0, as_yaml.stderr
    assert [r["job_id"] for r in yaml.safe_load(as_yaml.stdout)] == [newest, f"tester/{names[0]}"]

    wide = await iris(stack, "job", "list", "--limit", "2", "-o", "wide")
    header = wide.stdout.splitlines()[0].split()
    assert header[:4] == ["JOB", "ID", "STATE", "POS"] and "CODE" in header and "STARTED" in header
    table = await iris(stack, "job", "list", "--limit", "2")
    assert "CODE" not in table.stdout.splitlines()[0] and newest in table.stdout

    # --since: a job started longer ago than that is left out.
    await asyncio.sleep(3)  # not a wait: real time must pass, the job must be older than --since 2s
    recent = json.loads((await iris(stack, "job", "list", "--since", "2s", "-o", "json")).stdout)
    assert newest not in [r["job_id"] for r in recent]

    for args, message in (
        (("-o", "xml"), "unknown output format 'xml'"),
        (("--limit", "0"), "invalid --limit 0"),
        (("--since", "soon"), "invalid --since 'soon'"),
        (("--json", "-o", "yaml"), "--json is -o json"),
    ):
        bad = await iris(stack, "job", "list", *args)
        assert bad.code == 2 and bad.stdout == "", (args, bad)
        assert bad.stderr.count("\n") == 1 and message in bad.stderr, (args, bad.stderr)


async def test_queued_jobs_show_their_position_in_list_and_describe(stack: Stack) -> None:
    tag = secrets.token_hex(3)
    pinned = ("--target-cluster", "cw-rno2a", "--device-type", "h100", "--gpu-count", "8")
    ids = [f"tester/pos-{i}-{tag}" for i in range(3)]
    try:
        first = await iris(
            stack, "job", "run", "--no-wait", "--job-name", f"pos-0-{tag}", *pinned, "--", "sleep", "120"
        )
        assert first.code == 0, first.stderr

        async def first_runs() -> bool:
            return await state_of(stack, ids[0]) is JobState.RUNNING

        await wait_until(first_runs, timeout=60, what="the first job to run on cw-rno2a")
        for i in (1, 2):
            run = await iris(
                stack, "job", "run", "--no-wait", "--job-name", f"pos-{i}-{tag}", *pinned, "--", "true"
            )
            assert run.code == 0, run.stderr

        async def both_queued() -> bool:
            states = [await state_of(stack, j) for j in ids[1:]]
            return all(s is JobState.QUEUED_HANDOFF for s in states)

        await wait_until(both_queued, timeout=60, what="the other two to queue")
        # Distinct submit times (one CLI process after the other): the planner's order is theirs.
        submitted = [(await stack.iris.describe(j)).submit_ms for j in ids[1:]]
        assert submitted[0] < submitted[1], submitted

        listed = await iris(stack, "job", "list", "--state", "QUEUED_HANDOFF", "-o", "json")
        assert listed.code == 0, listed.stderr
        rows = {r["job_id"]: r for r in json.loads(listed.stdout)}
        second, third = rows[ids[1]]["position"], rows[ids[2]]["position"]
        # The same shape, the earlier one first; whatever else waits for H100s is counted in `of`.
        assert second["shape"] == third["shape"] == "device-type=gpu, device-variant=h100"
        assert second["position"] + 1 == third["position"] and second["of"] == third["of"] >= 2

        table = await iris(stack, "job", "list", "--state", "QUEUED_HANDOFF")
        line = next(x for x in table.stdout.splitlines() if x.startswith(ids[2]))
        assert f"{third['position']}/{third['of']}" in line.split(), line

        described = await iris(stack, "job", "describe", f"pos-2-{tag}")
        assert described.code == 0, described.stderr
        lines = described.stdout.splitlines()
        assert f"Queue position: {third['position']} of {third['of']} waiting for {third['shape']}" in lines
        reason = next(x for x in lines if x.startswith("Reason:"))
        code = (await stack.iris.describe(ids[2])).reason_code
        assert reason.startswith(f"Reason:         {code}: " if code else "Reason:         Queued"), reason
        as_json = json.loads((await iris(stack, "job", "describe", "--json", ids[2])).stdout)
        assert as_json["queue_position"] == third
        # A job that is not queued has no position.
        running = await iris(stack, "job", "describe", f"pos-0-{tag}")
        assert not any(x.startswith("Queue position:") for x in running.stdout.splitlines())
    finally:
        for job_id in ids:
            await iris(stack, "job", "cancel", job_id)


async def test_dry_run_starts_nothing_and_names_each_peers_verdict(stack: Stack, tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "train.py").write_text(f"print('never run {secrets.token_hex(8)}')\n")
    bundle = pack(workspace)
    assert bundle is not None
    home_store = stack.config.home_cluster.object_store
    assert home_store is not None
    home = open_store(home_store)
    since = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")

    dry = await iris(
        stack,
        "job",
        "run",
        "--dry-run",
        "--device-type",
        "h100",
        "--gpu-count",
        "8",
        "train.py",
        cwd=workspace,
    )
    assert dry.code == 0, dry.stderr
    lines = dry.stdout.splitlines()
    assert lines[0].startswith("Job:            tester/train-") and "dry run" in lines[0]
    assert lines[1].startswith("Classification: queue")
    assert lines[2].startswith("Would:          ")
    peers = lines[lines.index("Peers:") + 2 :]
    named = {p for row in peers for p in row.split(None, 1)[1].split("  ")[0].split(", ")}
    assert named == {c.name for c in stack.config.clusters}, peers
    verdicts = {row.split()[0] for row in peers}
    assert verdicts <= {"chosen", "fits", "full", "per_tick_cap", "no_shape", "unreachable", "stale"}
    assert any(row.split()[0] == "no_shape" and "marin" in row for row in peers), peers

    rejected = await iris(
        stack, "job", "run", "--dry-run", "--device-type", "b200", "--gpu-count", "1", "--", "true"
    )
    assert rejected.code == 2, rejected
    assert "Classification: reject" in rejected.stdout and "Would:          be rejected" in rejected.stdout

    # Nothing started, nothing stored: read once a job started after both dry runs is listed, so
    # visibility has caught up with anything they would have started.
    after = await stack.iris.submit(["true"], name=f"after-dry-run-{secrets.token_hex(3)}")
    await listed_after(stack, after)
    for job_id in (job_id_of(dry), job_id_of(rejected)):
        assert (await stack.client.count_workflows(f"WorkflowId = '{job_id}'")).count == 0, job_id
    assert await job_workflows_since(stack, since) == {after}
    assert not await asyncio.to_thread(home.exists, home_key(bundle.ref.sha256))


async def test_a_job_file_with_flags_overriding_its_values(stack: Stack, tmp_path: Path) -> None:
    name = f"from-file-{secrets.token_hex(3)}"
    job = tmp_path / "job.yaml"
    job.write_text(
        f"""\
name: {name}-file
command: [sh, -c, 'echo "$GREETING from $WHO"']
workdir: null
priority: batch
resources: {{device_type: cpu}}
env: {{GREETING: hello, WHO: the-file}}
retries: {{failure: 2}}
timeout: 10m
"""
    )
    run = await iris(
        stack,
        "job",
        "run",
        "-f",
        str(job),
        "--job-name",
        name,
        "--priority",
        "interactive",
        "-e",
        "WHO=a-flag",
    )
    assert run.code == 0, run.stderr
    assert run.stdout.splitlines() == [f"tester/{name}", "hello from a-flag"], run.stdout
    spec = (await stack.iris.describe(f"tester/{name}")).spec
    assert spec is not None
    assert (spec.name, spec.band.label, spec.timeout_s, spec.max_retries_failure) == (
        name,
        "interactive",
        600.0,
        2,
    )
    assert spec.env == {"GREETING": "hello", "WHO": "a-flag"}
    assert spec.bundle is None

    # The same file dry-run: JSON works as well as YAML.
    as_json = tmp_path / "job.json"
    as_json.write_text(json.dumps(yaml.safe_load(job.read_text())))
    dry = await iris(stack, "job", "run", "-f", str(as_json), "--dry-run")
    assert dry.code == 0, dry.stderr
    assert dry.stdout.startswith(f"Job:            tester/{name}-file (dry run")
