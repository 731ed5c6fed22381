"""Hostile input (docs/DESIGN.md, "Interfaces"): malformed submissions through the CLI and the SDK.

Each one must end in one clear error line and a non-zero exit, with no workflow started: the number
of JobWorkflow executions in the session's Temporal is the same before and after, and no job with
the name a case asked for exists.
"""

from __future__ import annotations

import asyncio
import math
import os
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest
from stack import VENV_BIN, Stack, wait_until

from iris.client import (
    MAX_COMMAND_ARGS,
    InvalidJob,
    IrisError,
    JobAlreadyExists,
    JobNotFound,
    JobRejected,
    build_spec,
)

RUN = uuid.uuid4().hex[:6]


@dataclass
class CliCase:
    id: str
    args: list[str | bytes]
    expect: str
    code: int = 2
    env: dict[str, str | bytes] = field(default_factory=dict)
    # The job name the case would have created, had it been accepted.
    name: str | None = None


def case(id: str, *args: str | bytes, expect: str, code: int = 2, **env: str | bytes) -> CliCase:
    return CliCase(id, list(args), expect, code, dict(env))


def run_case(
    id: str, *options: str | bytes, command: tuple[str | bytes, ...] = ("true",), expect: str
) -> CliCase:
    """``iris job run OPTIONS --job-name N -- COMMAND``, N unique so its absence can be checked."""
    name = f"hostile-{RUN}-{id}"
    return CliCase(id, ["job", "run", *options, "--job-name", name, "--", *command], expect, name=name)


CLI_CASES: list[CliCase] = [
    run_case(
        "negative-gpus", "--device-type", "h100", "--gpu-count", "-1", expect="--gpu-count must be >= 0"
    ),
    run_case("huge-gpus", "--device-type", "h100", "--gpu-count", "100000", expect="larger than the maximum"),
    run_case(
        "astronomic-gpus", "--device-type", "h100", "--gpu-count", "9" * 40, expect="larger than the maximum"
    ),
    run_case("absurd-replicas", "--replicas", "1000000", expect="--replicas 1000000 is larger"),
    run_case("unknown-device", "--device-type", "quantum", "--gpu-count", "1", expect="job rejected"),
    run_case(
        "shell-in-device", "--device-type", "h100;rm -rf /", "--gpu-count", "1", expect="invalid device type"
    ),
    run_case(
        "conflicting-variant",
        "--device-type",
        "h100",
        "--device-variant",
        "a100",
        "--gpu-count",
        "1",
        expect="conflicts with --device-variant",
    ),
    run_case("artifact-http", "--artifact", "http://evil.example/x", expect="invalid artifact URI"),
    run_case(
        "artifact-newline", "--artifact", "s3://bucket/x\nforged log line", expect="invalid artifact URI"
    ),
    run_case("artifact-uppercase-bucket", "--artifact", "s3://Bucket_X/k", expect="invalid artifact URI"),
    run_case("unknown-peer", "--target-cluster", "cw-nowhere", expect="unknown cluster 'cw-nowhere'"),
    run_case("blank-peer", "--target-cluster", "   ", expect="--target-cluster must not be empty"),
    run_case("env-bad-name", "--env", "1BAD=x", expect="invalid environment variable name"),
    run_case("env-no-equals", "--env", "NOEQUALS", expect="expected KEY=VALUE"),
    run_case("env-oversized", "--env", "BIG=" + "x" * 70_000, expect="environment is larger than"),
    run_case("env-non-utf8", "--env", b"K=\xff\xfe", expect="must be a UTF-8 string"),
    run_case("invalid-band", "--priority", "urgent", expect="unknown priority band 'urgent'"),
    run_case("negative-deadline", "--scheduling-timeout", "-5m", expect="between 1s and 30 days"),
    run_case(
        "deadline-not-a-duration",
        "--scheduling-timeout",
        "soon",
        expect="invalid --scheduling-timeout 'soon'",
    ),
    run_case("deadline-nan", "--scheduling-timeout", "nan", expect="between 1s and 30 days"),
    run_case("command-non-utf8", command=("echo", b"\xff\xfe"), expect="command is not valid UTF-8"),
    run_case("command-empty-string", command=("",), expect="no command given"),
    run_case("command-oversized", command=("echo", "x" * 70_000), expect="command is larger than"),
    run_case("oversized-zone", "--zone", "z" * 5000, expect="invalid --zone"),
    run_case("control-char-region", "--region", "us\x1b[31m", expect="invalid --region"),
    case(
        "name-traversal",
        "job",
        "run",
        "--job-name",
        "../../etc/passwd",
        "--",
        "true",
        expect="invalid job name",
    ),
    case("name-reserved", "job", "run", "--job-name", "logs", "--", "true", expect="invalid job id"),
    case("name-non-utf8", "job", "run", "--job-name", b"j\xff", "--", "true", expect="invalid job name"),
    case("user-non-utf8", "job", "run", "--", "true", expect="invalid user", IRIS_USER=b"eve\xff"),
    case("user-dot", "job", "run", "--", "true", expect="invalid job id", IRIS_USER=".hidden"),
    case("user-oversized", "job", "run", "--", "true", expect="invalid user", IRIS_USER="u" * 300),
]
USAGE_ERRORS = [
    case("no-command", "job", "run", "--", expect="no command given"),
    case("gpus-not-a-number", "job", "run", "--gpu-count", "eight", "--", "true", expect="--gpu-count"),
]


def now() -> str:
    """The visibility store's time format, to the microsecond."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


async def job_workflows(stack: Stack, since: str) -> int:
    """The JobWorkflows started since ``since``: a test's own, whatever earlier tests of the same
    stack delete meanwhile (a deletion is asynchronous: CI run J counted one fewer job workflow
    after the CLI cases than before them, when test_determinism_ops_cli's deleted run left the
    visibility store)."""
    query = f"WorkflowType = 'JobWorkflow' AND StartTime >= '{since}'"
    return (await stack.client.count_workflows(query)).count


async def cli(stack: Stack, c: CliCase) -> tuple[int, str, str]:
    env: dict[bytes, bytes] = {os.fsencode(k): os.fsencode(v) for k, v in stack.cli_env().items()}
    env.update({os.fsencode(k): os.fsencode(v) for k, v in c.env.items()})
    proc = await asyncio.create_subprocess_exec(
        str(VENV_BIN / "iris"),
        *c.args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one error line, got {len(lines)}:\n{stderr}"
    assert lines[0].startswith("error: "), lines[0]
    assert len(lines[0]) < 400, f"error line of {len(lines[0])} characters"
    return lines[0]


def check(c: CliCase, code: int, out: str, err: str) -> str | None:
    """What is wrong with the CLI's answer to a hostile case, or None."""
    lines = err.strip().splitlines()
    if code != c.code:
        return f"exit {code}, expected {c.code}"
    if out:
        return f"printed on stdout: {out[:100]!r}"
    if len(lines) != 1 or not lines[0].startswith("error: ") or len(lines[0]) > 400:
        return f"not one error line: {err[:300]!r}"
    if c.expect not in lines[0]:
        return f"error line lacks {c.expect!r}: {lines[0]}"
    return None


async def test_malformed_cli_submissions_are_one_error_line_and_start_nothing(
    stack: Stack, duplicate: str
) -> None:
    since = now()
    before = await job_workflows(stack, since)
    gate = asyncio.Semaphore(3)  # 2 cores: a few CLI processes at a time

    async def one(c: CliCase) -> tuple[CliCase, int, str, str]:
        async with gate:
            return (c, *await cli(stack, c))

    results = await asyncio.gather(*(one(c) for c in CLI_CASES))
    problems = []
    for c, code, out, err in results:
        print(f"{c.id:<28} exit {code}  {err.strip()[:110]}")
        problem = check(c, code, out, err)
        if problem:
            problems.append(f"{c.id}: {problem}")
        if c.name is not None:
            with pytest.raises(JobNotFound):
                await stack.iris.describe(f"tester/{c.name}")
    assert not problems, "\n".join(problems)
    assert await job_workflows(stack, since) == before


@pytest.mark.parametrize("c", USAGE_ERRORS, ids=lambda c: c.id)
async def test_cli_usage_errors_are_one_error_line(stack: Stack, c: CliCase) -> None:
    since = now()
    before = await job_workflows(stack, since)
    code, out, err = await cli(stack, c)
    assert await job_workflows(stack, since) == before
    assert code == 2 and c.expect in err
    assert check(c, code, out, err) is None


async def test_duplicate_job_id_through_the_cli_is_refused(stack: Stack, duplicate: str) -> None:
    since = now()
    before = await job_workflows(stack, since)
    name = duplicate.split("/", 1)[1]
    code, out, err = await cli(stack, case("dup", "job", "run", "--job-name", name, "--", "true", expect=""))
    assert code == 2 and out == ""
    assert one_error_line(err) == f"error: job {duplicate} already exists; choose another --job-name"
    assert await job_workflows(stack, since) == before


# ---- the SDK -----------------------------------------------------------------------------------

SDK_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("command-as-a-string", {"command": "python train.py"}, "command must be a list of strings"),
    ("command-of-bytes", {"command": [b"true"]}, "command must be a list of strings"),
    ("command-with-nul", {"command": ["echo", "a\x00b"]}, "NUL byte"),
    ("command-too-many-args", {"command": ["x"] * (MAX_COMMAND_ARGS + 1)}, "more than 4096 arguments"),
    ("env-value-nul", {"env": {"K": "a\x00b"}}, "without NUL bytes"),
    ("env-value-surrogate", {"env": {"K": "\udcff"}}, "UTF-8 string"),
    ("env-value-not-a-string", {"env": {"K": 5}}, "UTF-8 string"),
    ("env-key-newline", {"env": {"K\n": "v"}}, "invalid environment variable name"),
    ("gpus-fractional", {"device_type": "h100", "gpu_count": 1.5}, "--gpu-count must be a whole number"),
    ("gpus-as-text", {"device_type": "h100", "gpu_count": "8"}, "--gpu-count must be a whole number"),
    ("gpus-nan", {"device_type": "h100", "gpu_count": math.nan}, "--gpu-count must be a whole number"),
    ("gpus-bool", {"device_type": "h100", "gpu_count": True}, "--gpu-count must be a whole number"),
    ("replicas-fractional", {"replicas": 2.5}, "--replicas must be a whole number"),
    ("band-number", {"priority": 5}, "unknown priority band 5"),
    ("deadline-text", {"scheduling_timeout_s": "10m"}, "between 1s and 30 days"),
    ("deadline-infinite", {"scheduling_timeout_s": math.inf}, "between 1s and 30 days"),
    ("artifact-nul", {"artifacts": ["s3://bucket/x\x00"]}, "invalid artifact URI"),
    ("artifacts-as-a-string", {"artifacts": "s3://bucket/x"}, "artifacts must be a list"),
    ("artifacts-too-many", {"artifacts": ["s3://bucket/k"] * 5000}, "at most 1024 URIs"),
    ("user-newline", {"user": "eve\nadmin"}, "invalid user"),
    ("user-nul", {"user": "eve\x00"}, "invalid user"),
    ("name-trailing-newline", {"name": "job\n"}, "invalid job name"),
    ("name-terminate", {"name": "terminate"}, "invalid job id"),
    ("name-too-long", {"name": "n" * 100}, "invalid job name"),
    ("zero-replicas", {"replicas": 0}, "--replicas must be >= 1"),
    ("gpus-on-cpu", {"device_type": "cpu", "gpu_count": 8}, "needs a GPU device type"),
    ("gpu-without-count", {"device_type": "h100"}, "needs --gpu-count >= 1"),
    ("empty-band", {"priority": ""}, "unknown priority band"),
    ("zero-deadline", {"scheduling_timeout_s": 0}, "between 1s and 30 days"),
    ("deadline-too-far", {"scheduling_timeout_s": 400 * 86400}, "between 1s and 30 days"),
    ("artifact-no-path", {"artifacts": ["s3://"]}, "invalid artifact URI"),
    ("artifact-space", {"artifacts": ["gs://bucket/a b"]}, "invalid artifact URI"),
    ("empty-region", {"region": " "}, "--region must not be empty"),
]


@pytest.mark.parametrize(("id", "kwargs", "expect"), SDK_CASES, ids=[c[0] for c in SDK_CASES])
async def test_malformed_sdk_submission_raises_one_line_and_starts_nothing(
    stack: Stack, id: str, kwargs: dict[str, Any], expect: str
) -> None:
    since = now()
    before = await job_workflows(stack, since)
    kw = dict(kwargs)
    command = kw.pop("command", ["true"])
    with pytest.raises(InvalidJob) as built:
        build_spec(command, **kw)
    assert expect in str(built.value) and "\n" not in str(built.value), str(built.value)
    with pytest.raises(InvalidJob) as submitted:
        await stack.iris.submit(command, **kw)
    assert str(submitted.value) == str(built.value)
    assert await job_workflows(stack, since) == before


@pytest.mark.parametrize(
    ("id", "kwargs", "error", "expect"),
    [
        ("unknown-device", {"device_type": "quantum", "gpu_count": 1}, JobRejected, "device-variant=quantum"),
        ("unknown-peer", {"target_cluster": "cw-nowhere"}, JobRejected, "unknown cluster 'cw-nowhere'"),
        (
            "tpu-nowhere",
            {"device_type": "tpu-v9", "gpu_count": 4},
            JobRejected,
            "no backend in the federation",
        ),
        ("zone-nowhere", {"zone": "mars-1a"}, JobRejected, "zone=mars-1a"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
async def test_sdk_submission_no_cluster_can_host_is_rejected_before_starting(
    stack: Stack, id: str, kwargs: dict[str, Any], error: type[IrisError], expect: str
) -> None:
    since = now()
    before = await job_workflows(stack, since)
    name = f"hostile-{RUN}-sdk-{id}"
    with pytest.raises(error) as raised:
        await stack.iris.submit(["true"], name=name, **kwargs)
    assert expect in str(raised.value) and "\n" not in str(raised.value)
    assert raised.value.exit_code == 2
    with pytest.raises(JobNotFound):
        await stack.iris.describe(f"tester/{name}")
    assert await job_workflows(stack, since) == before


async def test_sdk_duplicate_is_refused_and_the_original_untouched(stack: Stack, duplicate: str) -> None:
    since = now()
    before = await job_workflows(stack, since)
    original = await stack.iris.describe(duplicate)
    with pytest.raises(JobAlreadyExists, match="already exists"):
        await stack.iris.submit(
            ["echo", "impostor"], name=duplicate.split("/", 1)[1], user="tester@example.com"
        )
    assert (await stack.iris.describe(duplicate)).spec == original.spec
    assert await job_workflows(stack, since) == before


async def test_the_count_is_a_real_witness(stack: Stack) -> None:
    """A valid submission does move the count, so an unchanged count above means nothing started."""
    since = now()
    before = await job_workflows(stack, since)
    job_id = await stack.iris.submit(["true"], name=f"hostile-{RUN}-witness")

    async def counted() -> bool:
        return await job_workflows(stack, since) == before + 1

    await wait_until(counted, timeout=30, what="the valid submission to be counted")
    await stack.iris.wait(job_id, timeout_s=60)
