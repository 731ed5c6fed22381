"""`iris job ...`: submit, list, describe, follow and cancel jobs."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer

from cli import common
from iris.client import IrisError, attempt_number, latest_attempt, prepare_submission
from iris.jobs import MAX_RETRIES, MAX_TIMEOUT_S, AttemptView, JobState, JobStatus

job_app = typer.Typer(help="Submit and inspect jobs.", no_args_is_help=True)


def _clock(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000).strftime("%H:%M:%S")


def _age(ms_or_dt: int | dt.datetime | None) -> str:
    if ms_or_dt is None:
        return "-"
    then = ms_or_dt.timestamp() if isinstance(ms_or_dt, dt.datetime) else ms_or_dt / 1000
    secs = max(0, int(dt.datetime.now().timestamp() - then))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{secs // size}{unit}"
    return f"{secs}s"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows as left-aligned columns, two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def _parse_env(items: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            common.fail(f"invalid --env {item!r}: expected KEY=VALUE", common.EXIT_INVALID)
        env[key] = value
    return env


def _parse_duration(text: str | None, flag: str) -> float | None:
    """``90s``, ``10m``, ``2h``, ``1d`` or plain seconds; the range is build_spec's to check."""
    if text is None:
        return None
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    t = text.strip().lower()
    try:
        if t and t[-1] in units:
            return float(t[:-1]) * units[t[-1]]
        return float(t)
    except ValueError:
        common.fail(f"invalid {flag} {text!r}: use e.g. 90s, 10m, 2h, 1d", common.EXIT_INVALID)


@job_app.command("run", context_settings={"allow_interspersed_args": False})
def run_command(
    command: Annotated[list[str], typer.Argument(help="The command to run, after `--`.", show_default=False)],
    target_cluster: Annotated[
        str | None, typer.Option("--target-cluster", help="Pin the job to this cluster.")
    ] = None,
    device_type: Annotated[
        str | None, typer.Option("--device-type", help="cpu, gpu, tpu, or a variant such as h100.")
    ] = None,
    device_variant: Annotated[str | None, typer.Option("--device-variant", help="e.g. h100.")] = None,
    gpu_count: Annotated[int, typer.Option("--gpu-count", help="Devices per replica.")] = 0,
    replicas: Annotated[int, typer.Option("--replicas", help="Replicas, all on one backend.")] = 1,
    priority: Annotated[
        str, typer.Option("--priority", help="production | interactive | batch.")
    ] = "interactive",
    region: Annotated[str | None, typer.Option("--region")] = None,
    zone: Annotated[str | None, typer.Option("--zone")] = None,
    preemptible: Annotated[
        bool | None, typer.Option("--preemptible/--no-preemptible", show_default=False)
    ] = None,
    artifact: Annotated[
        list[str] | None, typer.Option("--artifact", help="gs://… or s3://… that must exist (repeatable).")
    ] = None,
    env: Annotated[list[str] | None, typer.Option("--env", "-e", help="KEY=VALUE (repeatable).")] = None,
    scheduling_timeout: Annotated[
        str | None, typer.Option("--scheduling-timeout", help="Give up if not placed within, e.g. 10m.")
    ] = None,
    max_retries_failure: Annotated[
        int,
        typer.Option(
            "--max-retries-failure",
            metavar="N",
            help="Run the job again, up to N more times, after an attempt that failed: a replica "
            f"exited non-zero (0-{MAX_RETRIES}). A --timeout is never retried.",
        ),
    ] = 0,
    max_retries_preemption: Annotated[
        int,
        typer.Option(
            "--max-retries-preemption",
            metavar="N",
            help="Run the job again, up to N more times, after an attempt its cluster lost: the task "
            "died with its worker (WORKER_FAILED), the cluster forgot it, or the cluster was silent "
            f"past its peer_lost_after_s (0-{MAX_RETRIES}).",
        ),
    ] = 1,
    timeout: Annotated[
        str | None,
        typer.Option(
            "--timeout",
            metavar="DURATION",
            help="Wall-clock limit on each attempt's running, e.g. 90m or 2h (at most "
            f"{MAX_TIMEOUT_S / 86400:g}d): the cluster kills the job, which ends FAILED (timeout) and "
            "is never retried.",
        ),
    ] = None,
    job_name: Annotated[str | None, typer.Option("--job-name", help="Job name (id = user/name).")] = None,
    no_wait: Annotated[bool, typer.Option("--no-wait", help="Print the job id and return.")] = False,
    workdir: Annotated[
        Path,
        typer.Option(
            "--workdir",
            help="The workspace shipped with the job: the command runs in a copy of it on the "
            "cluster that runs the job (default: the current directory).",
            file_okay=False,
        ),
    ] = Path("."),
    no_workdir: Annotated[
        bool, typer.Option("--no-workdir", help="Ship no workspace: the command runs in an empty directory.")
    ] = False,
) -> None:
    """Submit a job: `iris job run --device-type=h100 --gpu-count=8 my_training_script.py`.

    The job runs in a copy of the current directory (or --workdir DIR), at most 25 MiB of files.

    .gitignore and .irisignore are honoured; .venv, .git, __pycache__ and .data are never shipped.

    A first argument ending in .py runs as `python FILE`, the first python on the running cluster's PATH.

    Name an interpreter to choose another: `python3.12 train.py`. --no-workdir ships nothing.

    Each delivery of the job to a cluster is an attempt: one that failed runs again only within
    --max-retries-failure (default 0), one its cluster lost within --max-retries-preemption
    (default 1); `iris job describe` lists them, `iris job logs --attempt N` prints one's output.
    """
    try:
        spec, bundle = prepare_submission(
            command,
            workdir=None if no_workdir else workdir,
            name=job_name,
            device_type=device_type,
            device_variant=device_variant,
            gpu_count=gpu_count,
            replicas=replicas,
            priority=priority,
            target_cluster=target_cluster,
            region=region,
            zone=zone,
            preemptible=preemptible,
            artifacts=artifact or [],
            env=_parse_env(env or []),
            scheduling_timeout_s=_parse_duration(scheduling_timeout, "--scheduling-timeout"),
            max_retries_failure=max_retries_failure,
            max_retries_preemption=max_retries_preemption,
            timeout_s=_parse_duration(timeout, "--timeout"),
        )
    except IrisError as exc:
        common.fail(str(exc), exc.exit_code)

    async def go() -> int:
        client = await common.client()
        job_id = await client.submit_spec(spec, bundle)
        typer.echo(job_id)
        if bundle is not None:
            typer.echo(f"workspace {workdir.resolve()}: bundle {bundle.ref.describe()}", err=True)
        if no_wait:
            return common.EXIT_OK

        printed = 0

        def show(st: JobStatus) -> None:
            # Every event since the last poll, so fast jobs still tell their whole story.
            nonlocal printed
            for ev in st.events[printed:]:
                typer.echo(f"{_clock(ev.at_ms)} {ev.state.value:<16} {ev.message}", err=True)
            printed = len(st.events)

        async def stream_logs() -> None:
            async for data in client.follow_logs(job_id):
                sys.stdout.write(data)
                sys.stdout.flush()

        logs = asyncio.create_task(stream_logs())
        try:
            final = await client.wait(job_id, on_change=show)
            # The relay is complete once the job is terminal: let the stream drain, briefly.
            with contextlib.suppress(TimeoutError, IrisError):
                await asyncio.wait_for(logs, timeout=30)
        except KeyboardInterrupt:
            typer.echo(f"stopped waiting; the job goes on (iris job cancel {job_id})", err=True)
            return common.EXIT_INTERRUPTED
        finally:
            logs.cancel()
        return common.EXIT_OK if final.state is JobState.SUCCEEDED else common.EXIT_JOB_FAILED

    raise typer.Exit(common.run(go()))


@job_app.command("list")
def list_command(
    state: Annotated[str | None, typer.Option("--state", help="Only jobs in this state.")] = None,
    peer: Annotated[str | None, typer.Option("--peer", help="Only jobs on this cluster.")] = None,
    user: Annotated[str | None, typer.Option("--user", help="Only jobs of this submitter.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines instead of a table.")] = False,
) -> None:
    """List jobs, newest first."""
    if state is not None and state.upper() not in JobState.__members__:
        common.fail(
            f"unknown state {state!r} (one of: {', '.join(JobState.__members__)})", common.EXIT_INVALID
        )

    async def go() -> None:
        client = await common.client()
        rows = await client.list(state=state, peer=peer, user=user)
        if as_json:
            typer.echo(json.dumps([r.model_dump(mode="json") for r in rows], indent=2))
            return
        header = ("JOB ID", "STATE", "CLUSTER", "BAND", "DEVICE", "USER", "AGE", "REASON")
        table = [header] + [
            (
                r.job_id,
                r.state,
                r.peer or "-",
                r.band or "-",
                r.device or "-",
                r.user or "-",
                _age(r.started_at),
                _clip(r.reason, 70),
            )
            for r in rows
        ]
        for line in _table(table):
            typer.echo(line)

    common.run(go())


@job_app.command("describe")
def describe_command(
    job_id: Annotated[str, typer.Argument(help="The job id, e.g. alice/train-llama-1a2b3c.")],
    as_json: Annotated[bool, typer.Option("--json", help="The full status as JSON.")] = False,
) -> None:
    """Where a job is, why, and how it got there."""

    async def go() -> None:
        client = await common.client()
        st = await client.describe(job_id)
        if as_json:
            typer.echo(st.model_dump_json(indent=2))
            return
        spec = st.spec
        lines = [
            f"Job:            {st.job_id}",
            f"State:          {st.state.value}",
            f"Reason:         {st.reason}",
            f"Cluster:        {st.cluster or '-'}" + (f" (backend {st.backend_id})" if st.backend_id else ""),
        ]
        if spec is not None:
            lines += [
                f"Submitted by:   {spec.user} at {_clock(spec.submit_ms)}",
                f"Command:        {shlex.join(spec.command)}",
                f"Workspace:      {spec.bundle.describe() if spec.bundle else 'none'}",
                f"Device:         {spec.device_label}   band: {spec.band.label}"
                + (f"   pinned to: {spec.target_cluster}" if spec.target_cluster else ""),
            ]
        if st.disposition:
            lines.append(f"Classification: {st.disposition} — {st.classification_reason}")
        if st.exit_code is not None:
            lines.append(f"Exit code:      {st.exit_code}")
        if st.error:
            lines.append(f"Error:          {st.error}")
        if st.handoff_attempts:
            lines.append(f"Handoffs:       {st.handoff_attempts}")
        if st.attempts:
            lines.append("Attempts:")
            lines += [f"  {row}" for row in _attempt_rows(st.attempts)]
        if st.tasks:
            lines.append("Tasks:")
            for t in st.tasks:
                exit_code = f" exit {t.exit_code}" if t.exit_code is not None else ""
                slots = f" slots {','.join(map(str, t.slots))}" if t.slots else ""
                lines.append(f"  replica {t.index}: {t.state}{exit_code}{slots}")
        lines.append("Events:")
        lines += [f"  {_clock(e.at_ms)}  {e.state.value:<16} {e.message}" for e in st.events]
        if st.cluster is not None:
            latest = latest_attempt(st)
            with contextlib.suppress(IrisError):
                tail = (await client.logs(job_id, attempt=latest)).data.splitlines()[-10:]
                if tail:
                    lines.append("Log tail:" if latest == 1 else f"Log tail (attempt {latest}):")
                    lines += [f"  {line}" for line in tail]
        typer.echo("\n".join(lines))

    common.run(go())


def _attempt_rows(attempts: list[AttemptView]) -> list[str]:
    """The attempts as an aligned table: number, cluster, start and end times, end, exit, reason."""
    header = ("#", "CLUSTER", "STARTED", "ENDED", "END", "EXIT", "REASON")
    table = [header] + [
        (
            str(a.number),
            a.cluster,
            _clock(a.started_ms),
            _clock(a.ended_ms) if a.ended_ms is not None else "-",
            a.end or "-",
            str(a.exit_code) if a.exit_code is not None else "-",
            a.reason or "-",
        )
        for a in attempts
    ]
    return _table(table)


@job_app.command("logs")
def logs_command(
    job_id: Annotated[str, typer.Argument(help="The job id.")],
    follow: Annotated[
        bool,
        typer.Option(
            "--follow", "-f", help="Stream until the job ends (through later attempts, without --attempt)."
        ),
    ] = False,
    attempt: Annotated[
        int | None,
        typer.Option(
            "--attempt",
            metavar="N",
            help="The output of attempt N (as `iris job describe` numbers them); default: the latest.",
        ),
    ] = None,
) -> None:
    """Print a job's output (stdout and stderr) of its latest attempt, relayed home from wherever
    it ran; --attempt N for an earlier one."""

    async def go() -> None:
        client = await common.client()
        if follow:
            async for data in client.follow_logs(job_id, attempt=attempt):
                sys.stdout.write(data)
                sys.stdout.flush()
            return
        # One attempt throughout (offsets are per attempt), even if a later one starts meanwhile.
        number = attempt_number(await client.describe(job_id), attempt)
        offset = 0
        while True:
            chunk = await client.logs(job_id, offset, attempt=number)
            sys.stdout.write(chunk.data)
            if not chunk.data or chunk.next_offset == offset:
                break
            offset = chunk.next_offset
        sys.stdout.flush()

    common.run(go())


@job_app.command("cancel")
def cancel_command(
    job_id: Annotated[str, typer.Argument(help="The job id.")],
    reason: Annotated[
        str, typer.Option("--reason", help="Recorded in the job's history.")
    ] = "Cancelled by user",
) -> None:
    """Cancel a job, saying whether the cancel won the race against its handoff."""

    async def go() -> None:
        client = await common.client()
        outcome = await client.cancel_and_report(job_id, reason)
        verdict = "won" if outcome.won else "lost"
        typer.echo(f"{job_id}: cancel {verdict} ({outcome.state.value}): {outcome.message}")

    common.run(go())
