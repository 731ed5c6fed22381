"""Attempts at the CLI and SDK, with no service (docs/DESIGN.md, "Attempts"): the retry budgets and
the run timeout a submission carries, the attempts `iris job describe` lists, the log of each
attempt (`iris job logs --attempt N`), and `iris ops replay-handoff --force`.

The CLI runs in this process through ``cli.app.main`` (its one-line errors and exit codes), with
``cli.common.client`` replaced: a command that got past validation would reach the replacement,
and a refused one must not.
"""

from __future__ import annotations

import getpass
import json
import math
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from cli_main import iris
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

from cli import common
from iris.client import AsyncIrisClient, InvalidJob, build_spec
from iris.config import load_config
from iris.jobs import MAX_RETRIES, MAX_TIMEOUT_S, AttemptView, JobSpec, JobState, JobStatus, ReplayRequest
from iris.logrelay import RelayedChunk
from iris.userauth import ensure_user_key, user_key_path

JOB = "alice/retried"
NOW_MS = 1_796_000_000_000
REFUSAL = (
    f"job {JOB} may be running on cw-a: its last launch went unanswered and that cluster has not said "
    "since; another cluster could run it twice. Wait until it answers (replay to it is safe), or replay "
    "with --force"
)


class Recorder:
    """Stands in for the SDK client the CLI would connect: records what reaches it."""

    def __init__(self) -> None:
        self.specs: list[JobSpec] = []
        self.replays: list[dict[str, Any]] = []
        self.status: JobStatus | None = None
        self.refusal: str | None = None

    async def submit_spec(self, spec: JobSpec, bundle: object) -> str:
        self.specs.append(spec)
        return spec.job_id

    async def describe(self, job_id: str) -> JobStatus:
        assert self.status is not None
        return self.status

    async def replay_handoff(self, job_id: str, **kw: Any) -> str:
        self.replays.append(kw)
        if self.refusal is not None:
            raise InvalidJob(self.refusal)
        return "replay accepted: to cw-b (operator replay)"


@pytest.fixture
def connected(monkeypatch: pytest.MonkeyPatch) -> Callable[[Any], list[int]]:
    """``connected(client)``: the CLI gets ``client``; the returned list counts connections."""

    def install(client: Any) -> list[int]:
        connections: list[int] = []

        async def connect() -> Any:
            connections.append(1)
            return client

        monkeypatch.setattr(common, "client", connect)
        return connections

    return install


def attempt(
    n: int, cluster: str, *, end: str | None = None, exit_code: int | None = None, reason: str | None = None
) -> AttemptView:
    return AttemptView(
        number=n,
        cluster=cluster,
        backend_id=f"{cluster}-gpu",
        nonce=f"{JOB}@1" if n == 1 else f"{JOB}@1#{n}",
        started_ms=NOW_MS + n * 60_000,
        ended_ms=None if end is None else NOW_MS + n * 60_000 + 30_000,
        end=end,
        exit_code=exit_code,
        reason=reason,
    )


def job_status(state: JobState, *attempts: AttemptView) -> JobStatus:
    return JobStatus(
        job_id=JOB,
        state=state,
        reason=f"{state.value} for the test",
        cluster=attempts[-1].cluster if attempts else None,
        attempts=list(attempts),
        submit_ms=NOW_MS,
    )


# ---- the budgets and the timeout a submission carries ------------------------------------------


def test_the_sdk_defaults_are_the_job_specs() -> None:
    spec = build_spec(["true"])
    assert (
        (spec.max_retries_failure, spec.max_retries_preemption, spec.timeout_s)
        == (
            JobSpec.model_fields["max_retries_failure"].default,
            JobSpec.model_fields["max_retries_preemption"].default,
            JobSpec.model_fields["timeout_s"].default,
        )
        == (0, 1, None)
    )


def test_the_sdk_puts_budgets_and_timeout_into_the_spec() -> None:
    spec = build_spec(["true"], max_retries_failure=3, max_retries_preemption=0, timeout_s=5400)
    assert (spec.max_retries_failure, spec.max_retries_preemption, spec.timeout_s) == (3, 0, 5400.0)
    spec = build_spec(["true"], max_retries_failure=MAX_RETRIES, timeout_s=MAX_TIMEOUT_S)
    assert (spec.max_retries_failure, spec.timeout_s) == (MAX_RETRIES, MAX_TIMEOUT_S)


@pytest.mark.parametrize(
    ("kw", "expect"),
    [
        ({"max_retries_failure": -1}, "--max-retries-failure must be a whole number from 0 to 100, got -1"),
        ({"max_retries_failure": MAX_RETRIES + 1}, "--max-retries-failure must be a whole number"),
        ({"max_retries_failure": 1.5}, "--max-retries-failure must be a whole number"),
        ({"max_retries_failure": True}, "--max-retries-failure must be a whole number"),
        ({"max_retries_failure": "2"}, "--max-retries-failure must be a whole number"),
        ({"max_retries_preemption": -1}, "--max-retries-preemption must be a whole number"),
        ({"max_retries_preemption": None}, "--max-retries-preemption must be a whole number"),
        ({"timeout_s": 0}, "--timeout must be more than 0s and at most 365 days, got 0s"),
        ({"timeout_s": -60.0}, "--timeout must be more than 0s"),
        ({"timeout_s": math.nan}, "--timeout must be more than 0s"),
        ({"timeout_s": math.inf}, "--timeout must be more than 0s"),
        ({"timeout_s": MAX_TIMEOUT_S + 1}, "--timeout must be more than 0s and at most 365 days"),
        ({"timeout_s": True}, "--timeout must be more than 0s"),
        ({"timeout_s": "10m"}, "--timeout must be more than 0s"),
    ],
)
def test_the_sdk_refuses_bad_budgets_and_timeouts_in_one_line(kw: dict[str, Any], expect: str) -> None:
    with pytest.raises(InvalidJob) as refused:
        build_spec(["true"], **kw)
    assert str(refused.value).startswith(expect)
    assert "\n" not in str(refused.value)
    assert refused.value.exit_code == 2


def test_the_cli_puts_budgets_and_timeout_into_the_spec_it_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], connected: Callable[[Any], list[int]]
) -> None:
    rec = Recorder()
    connected(rec)
    code, out, err = iris(
        monkeypatch,
        capsys,
        "job",
        "run",
        "--no-wait",
        "--no-workdir",
        "--job-name",
        "budgets",
        "--max-retries-failure",
        "3",
        "--max-retries-preemption",
        "0",
        "--timeout",
        "90m",
        "--",
        "true",
    )
    assert code == 0, err
    [spec] = rec.specs
    assert out.strip() == spec.job_id
    assert (spec.max_retries_failure, spec.max_retries_preemption, spec.timeout_s) == (3, 0, 5400.0)

    code, _, err = iris(
        monkeypatch, capsys, "job", "run", "--no-wait", "--no-workdir", "--timeout", "2d", "--", "true"
    )
    assert code == 0, err
    assert (rec.specs[-1].max_retries_failure, rec.specs[-1].max_retries_preemption) == (0, 1)
    assert rec.specs[-1].timeout_s == 2 * 86400


def test_the_cli_help_says_what_each_budget_retries_and_that_a_timeout_is_never_retried(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = iris(monkeypatch, capsys, "job", "run", "--help")
    assert code == 0
    text = " ".join(out.replace("│", " ").split())
    for needle in (
        "--max-retries-failure",
        "exited non-zero",
        "--max-retries-preemption",
        "WORKER_FAILED",
        "peer_lost_after",
        "--timeout",
        "never retried",
    ):
        assert needle in text, needle


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (
            ["--max-retries-failure", "-1"],
            "error: --max-retries-failure must be a whole number from 0 to 100, got -1",
        ),
        (
            ["--max-retries-failure", "101"],
            "error: --max-retries-failure must be a whole number from 0 to 100",
        ),
        (
            ["--max-retries-preemption", "-2"],
            "error: --max-retries-preemption must be a whole number from 0 to 100",
        ),
        (["--max-retries-failure", "two"], "error: Invalid value for '--max-retries-failure'"),
        (["--timeout", "soon"], "error: invalid --timeout 'soon': use e.g. 90s, 10m, 2h, 1d"),
        (["--timeout", "0"], "error: --timeout must be more than 0s and at most 365 days, got 0s"),
        (["--timeout", "-5m"], "error: --timeout must be more than 0s and at most 365 days, got -300s"),
        (["--timeout", "366d"], "error: --timeout must be more than 0s and at most 365 days"),
        (["--timeout", "nan"], "error: --timeout must be more than 0s"),
        (["--scheduling-timeout", "later"], "error: invalid --scheduling-timeout 'later'"),
    ],
)
def test_the_cli_refuses_bad_budgets_and_timeouts_in_one_line_and_starts_nothing(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    connected: Callable[[Any], list[int]],
    args: list[str],
    expect: str,
) -> None:
    rec = Recorder()
    connections = connected(rec)
    code, out, err = iris(monkeypatch, capsys, "job", "run", "--no-wait", "--no-workdir", *args, "--", "true")
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(expect), err
    assert out == ""
    assert connections == [] and rec.specs == []


# ---- describe and logs: every attempt -----------------------------------------------------------


class LogsClient(AsyncIrisClient):
    """The real SDK's attempt and log logic over scripted statuses and an in-memory relay."""

    def __init__(self, statuses: list[JobStatus], logs: dict[str, list[str]]) -> None:
        super().__init__(cast(Client, None), load_config())
        self.statuses = statuses
        self.relay_reads: list[tuple[str, int]] = []
        self.wanted: list[str] = []
        self._fake_logs = logs

    async def _want_logs(self, job_id: str) -> None:
        # The real one signals the workflow (want_logs): recorded here.
        self.wanted.append(job_id)

    async def describe(self, job_id: str) -> JobStatus:
        # One status per call until the last, which stays.
        return self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]

    async def _read_relay(self, job_id: str, attempt: int, offset: int) -> RelayedChunk:
        key = job_id if attempt == 1 else f"{job_id}#{attempt}"
        self.relay_reads.append((key, offset))
        pieces = self._fake_logs.get(key, [])
        # Each piece is one relayed object; the offset counts pieces here.
        if offset < len(pieces):
            return RelayedChunk(data=pieces[offset], next_offset=offset + 1)
        return RelayedChunk(data="", next_offset=offset)


RETRIED = job_status(
    JobState.SUCCEEDED,
    attempt(1, "cw-a", end="FAILED", exit_code=3, reason="Failed on cw-a: exit code 3"),
    attempt(2, "cw-b", end="SUCCEEDED", exit_code=0, reason="Succeeded on cw-b"),
)
LOGS = {JOB: ["first try\n", "oops\n"], f"{JOB}#2": ["second try\n"]}


def test_describe_lists_every_attempt_and_tails_the_latest_log(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], connected: Callable[[Any], list[int]]
) -> None:
    connected(LogsClient([RETRIED], LOGS))
    code, out, err = iris(monkeypatch, capsys, "job", "describe", JOB)
    assert code == 0, err
    lines = out.splitlines()
    at = lines.index("Attempts:")
    header, first, second = (line.split() for line in lines[at + 1 : at + 4])
    assert header == ["#", "CLUSTER", "STARTED", "ENDED", "END", "EXIT", "REASON"]
    assert first[:2] == ["1", "cw-a"] and first[4:6] == ["FAILED", "3"]
    assert " ".join(first[6:]) == "Failed on cw-a: exit code 3"
    assert second[:2] == ["2", "cw-b"] and second[4:6] == ["SUCCEEDED", "0"]
    assert "Log tail (attempt 2):" in lines and "  second try" in lines and "  oops" not in lines

    running = job_status(JobState.RUNNING, attempt(1, "cw-a"))
    connected(LogsClient([running], {JOB: ["going\n"]}))
    code, out, _ = iris(monkeypatch, capsys, "job", "describe", JOB)
    assert code == 0
    row = out.splitlines()[out.splitlines().index("Attempts:") + 2].split()
    assert row[:2] == ["1", "cw-a"] and row[3:] == ["-", "-", "-", "-"]
    assert "Log tail:" in out.splitlines()


def test_describe_json_carries_the_attempts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], connected: Callable[[Any], list[int]]
) -> None:
    connected(LogsClient([RETRIED], LOGS))
    code, out, _ = iris(monkeypatch, capsys, "job", "describe", "--json", JOB)
    assert code == 0
    attempts = json.loads(out)["attempts"]
    assert [(a["number"], a["cluster"], a["end"], a["exit_code"]) for a in attempts] == [
        (1, "cw-a", "FAILED", 3),
        (2, "cw-b", "SUCCEEDED", 0),
    ]


def test_logs_print_the_latest_attempt_and_any_earlier_one_on_request(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], connected: Callable[[Any], list[int]]
) -> None:
    connected(LogsClient([RETRIED], LOGS))
    assert iris(monkeypatch, capsys, "job", "logs", JOB)[:2] == (0, "second try\n")
    assert iris(monkeypatch, capsys, "job", "logs", "--attempt", "1", JOB)[:2] == (0, "first try\noops\n")
    assert iris(monkeypatch, capsys, "job", "logs", "--attempt", "2", JOB)[:2] == (0, "second try\n")
    for bad, expect in (
        ("3", f"error: job {JOB} has no attempt 3 (its attempts: 1-2)"),
        ("0", "error: --attempt must be a whole number from 1, got 0"),
    ):
        code, out, err = iris(monkeypatch, capsys, "job", "logs", "--attempt", bad, JOB)
        assert (code, out, err.strip().splitlines()) == (2, "", [expect])


async def test_the_sdk_reads_each_attempts_log_under_its_own_key() -> None:
    client = LogsClient([RETRIED], LOGS)
    latest = await client.logs(JOB)
    assert (latest.data, latest.next_offset) == ("second try\n", 1)
    first = await client.logs(JOB, 1, attempt=1)
    assert (first.data, first.eof) == ("oops\n", False)
    assert (await client.logs(JOB, 2, attempt=1)).eof
    with pytest.raises(InvalidJob, match="has no attempt 5"):
        await client.logs(JOB, attempt=5)
    assert client.relay_reads == [(f"{JOB}#2", 0), (JOB, 1), (JOB, 2)]


async def test_following_a_retried_job_goes_on_into_its_next_attempt() -> None:
    """The status is read before each log read; an attempt seen ended has all its output relayed,
    and the stream moves on to the next attempt once that one starts."""
    first_running = job_status(JobState.RUNNING, attempt(1, "cw-a"))
    first_failed = job_status(JobState.QUEUED_HANDOFF, attempt(1, "cw-a", end="FAILED", exit_code=3))
    second_running = job_status(
        JobState.RUNNING, attempt(1, "cw-a", end="FAILED", exit_code=3), attempt(2, "cw-b")
    )
    script = [first_running, first_running, first_failed, first_failed, second_running, RETRIED]
    client = LogsClient(list(script), LOGS)
    got = [data async for data in client.follow_logs(JOB, poll_interval_s=0)]
    assert got == ["first try\n", "oops\n", "second try\n"]
    # Following asked the workflow to relay the running attempt's log (once: within a minute).
    assert client.wanted == [JOB]

    # One attempt only, when named: it ends with that attempt.
    client = LogsClient([first_failed], LOGS)
    assert [data async for data in client.follow_logs(JOB, attempt=1, poll_interval_s=0)] == [
        "first try\n",
        "oops\n",
    ]
    # A job that ended on its first attempt ends the stream there.
    client = LogsClient([job_status(JobState.FAILED, attempt(1, "cw-a", end="FAILED"))], LOGS)
    assert [data async for data in client.follow_logs(JOB, poll_interval_s=0)] == ["first try\n", "oops\n"]


async def test_following_a_job_just_submitted_starts_at_its_first_attempt() -> None:
    """`iris job run` follows from attempt 1: a short first attempt may have failed and been retried
    before the stream's first read (the stop's CI saw `first` lost that way)."""
    second_running = job_status(
        JobState.RUNNING, attempt(1, "cw-a", end="FAILED", exit_code=3), attempt(2, "cw-b")
    )
    client = LogsClient([second_running, second_running, second_running, RETRIED], LOGS)
    got = [data async for data in client.follow_logs(JOB, from_first=True, poll_interval_s=0)]
    assert got == ["first try\n", "oops\n", "second try\n"]
    # Without it, following starts at the latest attempt (`iris job logs -f`).
    client = LogsClient([second_running, RETRIED], LOGS)
    assert [data async for data in client.follow_logs(JOB, poll_interval_s=0)] == ["second try\n"]


# ---- replay-handoff --force ---------------------------------------------------------------------

PARKED = job_status(JobState.HANDOFF_FAILED, attempt(1, "cw-a"))


def test_replay_force_warns_of_the_double_run_in_one_line_and_forces(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], connected: Callable[[Any], list[int]]
) -> None:
    rec = Recorder()
    rec.status = PARKED
    connected(rec)
    code, out, err = iris(monkeypatch, capsys, "ops", "replay-handoff", JOB, "--peer", "cw-b", "--force")
    assert code == 0, err
    assert err.strip().splitlines() == [
        f"warning: --force: the previous cluster (cw-a) may still run attempt 1 of {JOB}; it is fenced: "
        "terminated there as soon as it answers (until then the job may run twice)"
    ]
    assert out == f"{JOB}: replay accepted: to cw-b (operator replay)\n"
    assert rec.replays == [{"peer": "cw-b", "requeue": False, "reason": "operator replay", "force": True}]

    code, _, err = iris(monkeypatch, capsys, "ops", "replay-handoff", JOB, "--requeue", "--force")
    assert code == 0 and "may still run attempt 1" in err
    assert rec.replays[-1]["force"] is True and rec.replays[-1]["requeue"] is True

    # To the cluster of the last launch, forcing is not needed: it says so instead.
    code, _, err = iris(monkeypatch, capsys, "ops", "replay-handoff", JOB, "--force")
    assert code == 0
    assert err.strip().splitlines() == [
        "warning: --force: a replay to cw-a, the cluster of the last launch, needs no force"
    ]


def test_replay_without_force_shows_the_refusal_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], connected: Callable[[Any], list[int]]
) -> None:
    rec = Recorder()
    rec.status = PARKED
    rec.refusal = REFUSAL
    connected(rec)
    code, out, err = iris(monkeypatch, capsys, "ops", "replay-handoff", JOB, "--peer", "cw-b")
    assert (code, out) == (2, "")
    assert err.strip().splitlines() == [f"error: {REFUSAL}"]
    assert rec.replays == [{"peer": "cw-b", "requeue": False, "reason": "operator replay", "force": False}]


class UpdateHandle:
    """A running, parked job's workflow handle: its Update validator refuses a replay elsewhere
    unless forced, as JobWorkflow's does (tests/workflows/test_job_attempts.py)."""

    def __init__(self) -> None:
        self.sent: list[ReplayRequest] = []

    async def describe(self) -> SimpleNamespace:
        return SimpleNamespace(status=WorkflowExecutionStatus.RUNNING, run_id="run-1")

    async def execute_update(self, update: object, arg: ReplayRequest, *, id: str) -> str:
        self.sent.append(arg)
        if not arg.force:
            # What the SDK receives for a validator's ValueError: its type prefixes str().
            raise WorkflowUpdateFailedError(ApplicationError(REFUSAL, type="ValueError"))
        return f"replay accepted: {arg.describe()}"


async def test_the_sdk_passes_force_and_says_the_validators_refusal_as_its_own_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The replay is signed with the OS user's key: one of its own, not whatever the machine has.
    monkeypatch.setenv("IRIS_USER_KEY_DIR", str(tmp_path))
    ensure_user_key(user_key_path(getpass.getuser()))
    handle = UpdateHandle()
    temporal = SimpleNamespace(get_workflow_handle_for=lambda run, workflow_id: handle)
    client = AsyncIrisClient(cast(Client, temporal), load_config())

    async def describe(job_id: str) -> JobStatus:
        return PARKED

    client.describe = describe  # type: ignore[method-assign]
    with pytest.raises(InvalidJob) as refused:
        await client.replay_handoff(JOB, peer="cw-b")
    assert str(refused.value) == REFUSAL  # not "ValueError: job …"
    assert (
        await client.replay_handoff(JOB, peer="cw-b", force=True)
        == "replay accepted: to cw-b (operator replay)"
    )
    assert [(r.peer, r.force) for r in handle.sent] == [("cw-b", False), ("cw-b", True)]
