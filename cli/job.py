"""`iris job ...`: submit, list, describe, follow and cancel jobs."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer._click.core import ParameterSource

from cli import common
from iris.defaults import MAX_RETRIES, MAX_TIMEOUT_S

if TYPE_CHECKING:
    from iris.client import AsyncIrisClient, JobSummary
    from iris.jobs import AttemptView, JobSpec, JobStatus
    from iris.policy.models import Hold
    from iris.policy.queue import DryRun, QueuePosition

job_app = typer.Typer(rich_markup_mode=None, help="Submit and inspect jobs.", no_args_is_help=True)


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
    from iris.jobfile import parse_duration

    try:
        return parse_duration(text)
    except ValueError:
        common.fail(f"invalid {flag} {text!r}: use e.g. 90s, 10m, 2h, 1d", common.EXIT_INVALID)


JOB_ID_HELP = "The job id (alice/train-1a2b3c), or for one of your own jobs its name (train-1a2b3c)."
# `iris job list -o FORMAT`.
OUTPUTS = ("table", "wide", "json", "yaml")
# (build_spec keyword, `iris job run` parameter) of every flag a job file's value yields to.
_FLAG_OF = {
    "name": "job_name",
    "device_type": "device_type",
    "device_variant": "device_variant",
    "gpu_count": "gpu_count",
    "replicas": "replicas",
    "priority": "priority",
    "target_cluster": "target_cluster",
    "region": "region",
    "zone": "zone",
    "preemptible": "preemptible",
    "artifacts": "artifact",
    "scheduling_timeout_s": "scheduling_timeout",
    "max_retries_failure": "max_retries_failure",
    "max_retries_preemption": "max_retries_preemption",
    "timeout_s": "timeout",
}


def _given(ctx: typer.Context, param: str) -> bool:
    """Whether the user gave ``param`` (on the command line), rather than its default."""
    return ctx.get_parameter_source(param) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)


@job_app.command("run", context_settings={"allow_interspersed_args": False})
def run_command(
    ctx: typer.Context,
    command: Annotated[
        list[str] | None,
        typer.Argument(help="The command to run, after `--` (optional with -f).", show_default=False),
    ] = None,
    job_file: Annotated[
        Path | None,
        typer.Option(
            "--file",
            "-f",
            metavar="FILE",
            help="Read the job from a YAML or JSON file (schema: docs/job.schema.json). Flags given "
            "as well override the file's values; --env adds or replaces single variables.",
            dir_okay=False,
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Start nothing: print how the job would be classified, where it would go now and "
            "each peer's verdict (exit 0 if it would run or queue, 2 if it would be rejected).",
        ),
    ] = False,
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
            "died with its worker (WORKER_FAILED), or the cluster forgot it or was silent past its "
            "peer_lost_after_s. An attempt a higher-band job preempted is always queued again and "
            f"spends nothing (0-{MAX_RETRIES}).",
        ),
    ] = 1,
    timeout: Annotated[
        str | None,
        typer.Option(
            "--timeout",
            metavar="DURATION",
            help="Wall-clock limit on each attempt's running, e.g. 90m or 2h (at most "
            f"{MAX_TIMEOUT_S / 86400:g}d): the cluster kills the job, which ends FAILED (timeout) and "
            "is never retried. It is also the job's time limit for backfill: a job that ends soon enough "
            "may start ahead of one devices are held for.",
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
    """Submit a job: `iris job run --device-type=h100 --gpu-count=8 my_training_script.py`,
    or from a file: `iris job run -f job.yaml` (flags override its values).

    The job runs in a copy of the current directory (or --workdir DIR), at most 25 MiB of files.

    .gitignore and .irisignore are honoured; .venv, .git, __pycache__ and .data are never shipped.

    A first argument ending in .py runs as `python FILE`, the first python on the running cluster's PATH.

    Name an interpreter to choose another: `python3.12 train.py`. --no-workdir ships nothing.

    Each delivery of the job to a cluster is an attempt: one that failed runs again only within
    --max-retries-failure (default 0), one its cluster lost within --max-retries-preemption
    (default 1); `iris job describe` lists them, `iris job logs --attempt N` prints one's output.

    --dry-run starts nothing and stores nothing: the job is checked and its workspace bundled.

    The home cluster says what it would do with the job now (last reports, ledger and queue).

    `iris job run --dry-run --device-type=h100 --gpu-count=8 train.py`: exit 0 run or queue, 2 reject.

    -f job.yaml: the job from a file (docs/job.schema.json); flags given as well override it.
    """
    from iris.client import IrisError, prepare_submission

    flags: dict[str, Any] = {
        "name": job_name,
        "device_type": device_type,
        "device_variant": device_variant,
        "gpu_count": gpu_count,
        "replicas": replicas,
        "priority": priority,
        "target_cluster": target_cluster,
        "region": region,
        "zone": zone,
        "preemptible": preemptible,
        "artifacts": artifact or [],
        "scheduling_timeout_s": _parse_duration(scheduling_timeout, "--scheduling-timeout"),
        "max_retries_failure": max_retries_failure,
        "max_retries_preemption": max_retries_preemption,
        "timeout_s": _parse_duration(timeout, "--timeout"),
    }
    flag_env = _parse_env(env or [])
    shipped: Path | None = None if no_workdir else workdir
    if job_file is None:
        kw: dict[str, Any] = {**flags, "env": flag_env}
        cmd: list[str] = command or []
    else:
        from iris.jobfile import JobFileError, load_job_file

        try:
            from_file = load_job_file(job_file).submission()
        except JobFileError as exc:
            common.fail(str(exc), common.EXIT_INVALID)
        cmd = command or from_file.pop("command")
        from_file.pop("command", None)
        file_workdir = from_file.pop("workdir")
        if not (_given(ctx, "workdir") or _given(ctx, "no_workdir")):
            shipped = file_workdir
        kw = {
            key: flags[key] if _given(ctx, _FLAG_OF[key]) else value
            for key, value in from_file.items()
            if key != "env"
        }
        kw["env"] = {**from_file["env"], **flag_env}
    try:
        spec, bundle = prepare_submission(cmd, workdir=shipped, **kw)
    except IrisError as exc:
        common.fail(str(exc), exc.exit_code)

    if dry_run:
        raise typer.Exit(common.run(_dry_run(spec, bundle.ref.describe() if bundle is not None else None)))

    async def go() -> int:
        import asyncio

        from iris.jobs import JobState

        client = await common.client()
        job_id = await client.submit_spec(spec, bundle)
        typer.echo(job_id)
        if bundle is not None and shipped is not None:
            typer.echo(f"workspace {shipped.resolve()}: bundle {bundle.ref.describe()}", err=True)
        if no_wait:
            return common.EXIT_OK

        async def stream_logs() -> None:
            # From attempt 1: a short first attempt may have failed and been retried already.
            async for data in client.follow_logs(job_id, from_first=True):
                sys.stdout.write(data)
                sys.stdout.flush()

        logs = asyncio.create_task(stream_logs())
        try:
            final = await follow(client, job_id)
            if final.state is JobState.HANDOFF_FAILED:
                for line in parked_lines(final):
                    typer.echo(line, err=True)
                return common.EXIT_PARKED
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


# How often `iris job run` polls its job, and after how long without a line it says what the job
# is waiting for (its reason code and reason), again and again while the job waits.
FOLLOW_POLL_S = 0.25
WAITING_NOTE_S = 5.0


def held_line(hold: Hold, *, now_ms: int) -> str:
    """Where devices are held for a waiting job and from when (docs/DESIGN.md, "Backfill")."""
    wait_s = max(0, (hold.start_ms - now_ms) // 1000)
    when = "now" if wait_s == 0 else f"in {_span(wait_s)}"
    where = f"{hold.amount} {hold.token} on {hold.peer_id}/{hold.backend_id}"
    return (
        f"{where} from {_clock(hold.start_ms)} ({when}), as the jobs there reach their time limits;"
        " until then only jobs that end sooner use them"
    )


def _span(seconds: int) -> str:
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _event_line(at_ms: int, state: str, message: str) -> str:
    return f"{_clock(at_ms)} {state:<16} {message}"


async def follow(client: AsyncIrisClient, job_id: str) -> JobStatus:
    """Print the job's events as they happen until it ends, or parks in HANDOFF_FAILED (which
    only an operator's replay or a cancel moves on: waiting longer would wait for ever). While it
    waits and nothing was printed for WAITING_NOTE_S, one line says why: its reason code and reason."""
    import asyncio
    import time

    from iris.jobs import JobState

    printed = 0
    quiet_since = time.monotonic()
    while True:
        st = await client.describe(job_id)
        # Every event since the last poll, so fast jobs still tell their whole story.
        for ev in st.events[printed:]:
            typer.echo(_event_line(ev.at_ms, ev.state.value, ev.message), err=True)
            quiet_since = time.monotonic()
        printed = max(printed, len(st.events))
        if st.terminal or st.state is JobState.HANDOFF_FAILED:
            return st
        if st.state is not JobState.RUNNING and time.monotonic() - quiet_since >= WAITING_NOTE_S:
            code = f" [{st.reason_code.value}]" if st.reason_code is not None else ""
            now_ms = int(time.time() * 1000)
            typer.echo(_event_line(now_ms, st.state.value, f"still waiting{code}: {st.reason}"), err=True)
            quiet_since = time.monotonic()
        await asyncio.sleep(FOLLOW_POLL_S)


def parked_lines(st: JobStatus) -> list[str]:
    """What `iris job run` says when its job parks: why, and the exact command that replays it."""
    code = f" [{st.reason_code.value}]" if st.reason_code is not None else ""
    return [
        f"error: {st.job_id} is parked in {st.state.value}{code}: {st.reason}",
        "  it waits for an operator: once the cause is fixed, replay its handoff with",
        f"    iris ops replay-handoff {shlex.quote(st.job_id)}",
        f"  (--peer P for another cluster, --requeue for the queue; iris job cancel {shlex.quote(st.job_id)} "
        "gives up)",
    ]


def _verdict_rows(report: DryRun) -> list[str]:
    table = [("VERDICT", "PEERS", "WHY")] + [
        (v.outlook.value, ", ".join(v.peer_ids), v.message) for v in report.verdicts
    ]
    return _table(table)


def dry_run_lines(report: DryRun, bundle: str | None) -> list[str]:
    """What `iris job run --dry-run` prints."""
    from iris.policy.models import Disposition

    p = report.placement
    if report.rejected:
        outcome = f"be rejected: {report.classification}"
    elif p is not None and report.disposition is Disposition.LOCAL and report.pinned_cluster is None:
        outcome = f"run at home on {p.peer_id}/{p.backend_id} now"
    elif p is not None:
        where = f"{p.peer_id} (backend {p.backend_id})" if p.backend_id else p.peer_id
        outcome = f"be placed on {where} by the next placement tick"
    else:
        code = f" [{report.code}]" if report.code else ""
        outcome = f"wait in the queue{code}: {report.waiting or report.classification}"
    lines = [
        f"Job:            {report.job_id} (dry run: nothing was started or stored)",
        f"Classification: {report.disposition.value} — {report.classification}",
        f"Would:          {outcome}",
    ]
    if report.position is not None and not report.rejected:
        lines.append(f"Queue position: {report.position.describe()} ({report.queued} jobs queued now)")
    if bundle is not None:
        lines.append(f"Workspace:      {bundle} (checked, not stored)")
    lines.append("Peers:")
    lines += [f"  {row}" for row in _verdict_rows(report)]
    return lines


async def _dry_run(spec: JobSpec, bundle: str | None) -> int:
    client = await common.client()
    report = await client.dry_run(spec)
    typer.echo("\n".join(dry_run_lines(report, bundle)))
    return common.EXIT_INVALID if report.rejected else common.EXIT_OK


def _position(pos: QueuePosition | None) -> str:
    return f"{pos.position}/{pos.of}" if pos is not None else "-"


def _summary_tables(rows: Sequence[JobSummary], wide: bool) -> list[str]:
    if wide:
        header: tuple[str, ...] = (
            "JOB ID", "STATE", "POS", "CODE", "CLUSTER", "BAND", "DEVICE", "USER", "STARTED", "AGE", "REASON",
        )  # fmt: skip
    else:
        header = ("JOB ID", "STATE", "POS", "CLUSTER", "BAND", "DEVICE", "USER", "AGE", "REASON")
    table: list[Sequence[str]] = [header]
    for r in rows:
        started = r.started_at.astimezone().strftime("%Y-%m-%d %H:%M:%S") if r.started_at else "-"
        head = [r.job_id, r.state, _position(r.position)] + ([r.reason_code or "-"] if wide else [])
        tail = [r.peer or "-", r.band or "-", r.device or "-", r.user or "-"]
        tail += [started] if wide else []
        tail += [_age(r.started_at), r.reason if wide else _clip(r.reason, 70)]
        table.append(head + tail)
    return _table(table)


@job_app.command("list")
def list_command(
    state: Annotated[str | None, typer.Option("--state", help="Only jobs in this state.")] = None,
    peer: Annotated[str | None, typer.Option("--peer", help="Only jobs on this cluster.")] = None,
    user: Annotated[str | None, typer.Option("--user", help="Only jobs of this submitter.")] = None,
    since: Annotated[
        str | None,
        typer.Option("--since", metavar="DURATION", help="Only jobs started within, e.g. 90s, 10m, 2h, 1d."),
    ] = None,
    limit: Annotated[
        int | None, typer.Option("--limit", metavar="N", help="At most N jobs, the newest (default 1000).")
    ] = None,
    output: Annotated[
        str | None,
        typer.Option(
            "--output",
            "-o",
            metavar="FORMAT",
            help="table (default), wide (adds the reason code and start time, full reasons), json or yaml.",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="The same as -o json.")] = False,
    shares: Annotated[
        bool,
        typer.Option(
            "--shares",
            help="After the table, each user holding devices: chips held and dominant share (fair share).",
        ),
    ] = False,
) -> None:
    """List jobs, newest first: `iris job list --since 1h --limit 20 -o wide`.

    POS: a queued job's place among the jobs waiting for its shape, in the placement tick's order.

    2/5 means one job goes first and three after. -o json and -o yaml hold every field.
    """
    from iris.jobs import JobState

    if state is not None and state.upper() not in JobState.__members__:
        common.fail(
            f"unknown state {state!r} (one of: {', '.join(JobState.__members__)})", common.EXIT_INVALID
        )
    fmt = (output or ("json" if as_json else "table")).strip().lower()
    if fmt not in OUTPUTS:
        common.fail(f"unknown output format {output!r} (one of: {', '.join(OUTPUTS)})", common.EXIT_INVALID)
    if as_json and fmt != "json":
        common.fail(f"--json is -o json: it cannot go with -o {fmt}", common.EXIT_INVALID)
    if shares and fmt in ("json", "yaml"):
        common.fail(f"--shares goes with a table, not -o {fmt}", common.EXIT_INVALID)
    if limit is not None and limit < 1:
        common.fail(f"invalid --limit {limit}: at least 1", common.EXIT_INVALID)
    since_s = _parse_duration(since, "--since")
    if since_s is not None and not since_s > 0:
        common.fail(f"invalid --since {since!r}: a duration above 0s, e.g. 10m", common.EXIT_INVALID)

    async def go() -> None:
        from iris.client import IrisError

        client = await common.client()
        rows = await client.list(state=state, peer=peer, user=user, limit=limit or 1000, since_s=since_s)
        try:
            rows = await client.with_positions(rows)
        except IrisError as exc:
            typer.echo(f"warning: no queue positions: {exc}", err=True)
        if fmt in ("json", "yaml"):
            data = [r.model_dump(mode="json") for r in rows]
            if fmt == "json":
                text = json.dumps(data, indent=2)
            else:
                import yaml

                text = yaml.safe_dump(data, sort_keys=False)
            typer.echo(text.rstrip("\n"))
            return
        for line in _summary_tables(rows, wide=fmt == "wide"):
            typer.echo(line)
        if shares:
            try:
                users = (await client.queue_answer([])).users
            except IrisError as exc:
                typer.echo(f"warning: no shares: {exc}", err=True)
                return
            typer.echo("")
            for line in _table(
                [("USER", "DEVICES", "SHARE")]
                + [(u, str(s.devices), f"{s.share:.0%}") for u, s in users.items()]
            ):
                typer.echo(line)

    common.run(go())


@job_app.command("describe")
def describe_command(
    job_id: Annotated[str, typer.Argument(help=JOB_ID_HELP)],
    as_json: Annotated[bool, typer.Option("--json", help="The full status as JSON.")] = False,
) -> None:
    """Where a job is, why (its reason code and text), and how it got there.

    A queued job's position among the jobs waiting for the same shape is shown too.

    `iris job describe train-1a2b3c` names one of your own jobs; others' need their full id.
    """

    async def go() -> None:
        import time

        from iris.client import IrisError, latest_attempt
        from iris.jobs import JobState
        from iris.policy.reasons import ReasonCode

        client = await common.client()
        st = await client.describe(job_id)
        position: QueuePosition | None = None
        position_error = ""
        if st.state is JobState.QUEUED_HANDOFF:
            try:
                position = await client.position(st.job_id)
            except IrisError as exc:
                position_error = str(exc)
        if as_json:
            data = st.model_dump(mode="json")
            data["queue_position"] = position.model_dump(mode="json") if position is not None else None
            typer.echo(json.dumps(data, indent=2))
            return
        spec = st.spec
        code = f"{st.reason_code}: " if st.reason_code else ""
        lines = [
            f"Job:            {st.job_id}",
            f"State:          {st.state.value}",
            f"Reason:         {code}{st.reason}",
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
        if position is not None:
            lines.append(f"Queue position: {position.describe()}")
        if st.state is JobState.QUEUED_HANDOFF and st.reason_code is ReasonCode.Reserved and st.hold:
            lines.append(f"Reserved:       {held_line(st.hold, now_ms=int(time.time() * 1000))}")
        elif position_error:
            lines.append(f"Queue position: unknown ({position_error})")
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
        lines += [
            f"  {_clock(e.at_ms)}  {e.state.value:<16} {e.message}" + (f" [{e.code}]" if e.code else "")
            for e in st.events
        ]
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
    job_id: Annotated[str, typer.Argument(help=JOB_ID_HELP)],
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
    it ran; --attempt N for an earlier one. A running attempt's copy is refreshed first (~2 s)."""

    async def go() -> None:
        from iris.client import attempt_ended, attempt_number

        client = await common.client()
        if follow:
            async for data in client.follow_logs(job_id, attempt=attempt):
                sys.stdout.write(data)
                sys.stdout.flush()
            return
        # One attempt throughout (offsets are per attempt), even if a later one starts meanwhile.
        status = await client.describe(job_id)
        number = attempt_number(status, attempt)
        if not attempt_ended(status, number):
            await client.refresh_logs(job_id)
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
    job_id: Annotated[str, typer.Argument(help=JOB_ID_HELP)],
    reason: Annotated[
        str, typer.Option("--reason", help="Recorded in the job's history.")
    ] = "Cancelled by user",
) -> None:
    """Cancel a job, saying whether the cancel won the race against its handoff.

    `iris job cancel train-1a2b3c` names one of your own jobs; others' need their full id.
    """

    async def go() -> None:
        client = await common.client()
        outcome = await client.cancel_and_report(job_id, reason)
        verdict = "won" if outcome.won else "lost"
        typer.echo(f"{client.resolve(job_id)}: cancel {verdict} ({outcome.state.value}): {outcome.message}")

    common.run(go())
