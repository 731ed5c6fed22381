"""`iris ops replay-handoff`: an operator re-runs a failed handoff
(docs/DESIGN.md, "Replaying a failed handoff")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from cli import common

if TYPE_CHECKING:
    from iris.jobs import JobStatus


def force_warning(status: JobStatus, *, peer: str | None, requeue: bool) -> str | None:
    """The one line ``--force`` prints for a parked job: a replay elsewhere while the cluster of the
    last launch may still run that attempt, which is then fenced (terminated there as soon as it
    answers). None if the job is not parked: the replay is refused anyway."""
    from iris.jobs import JobState

    if status.state is not JobState.HANDOFF_FAILED:
        return None
    if not status.attempts:
        return (
            f"warning: --force: {status.job_id} was never launched, so it cannot run twice; nothing to fence"
        )
    last = status.attempts[-1]
    if not requeue and peer in (None, last.cluster):
        return f"warning: --force: a replay to {last.cluster}, the cluster of the last launch, needs no force"
    return (
        f"warning: --force: the previous cluster ({last.cluster}) may still run attempt {last.number} "
        f"of {status.job_id}; it is fenced: terminated there as soon as it answers (until then the "
        "job may run twice)"
    )


def replay_handoff_command(
    job_id: Annotated[str, typer.Argument(help="The job id.")],
    peer: Annotated[str | None, typer.Option("--peer", help="Hand off to this cluster instead.")] = None,
    requeue: Annotated[bool, typer.Option("--requeue", help="Send the job back to the queue.")] = False,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Replay elsewhere (--peer or --requeue) even though the cluster of the last launch, "
            "whose answer never came, may still run the job: that attempt is fenced (terminated "
            "there as soon as the cluster answers); until then the job may run twice.",
        ),
    ] = False,
    reason: Annotated[
        str, typer.Option("--reason", help="Recorded in the job's history.")
    ] = "operator replay",
) -> None:
    """Re-run artifact check + handoff for a job parked in HANDOFF_FAILED, or reset a closed
    HANDOFF_REJECTED run to just before its handoff. Refused for jobs in any other state.

    A replay elsewhere is refused while the last launch's cluster may still run the job (it
    accepted the launch, or not: its answer never came); wait until it answers, or use --force."""

    async def go() -> None:
        client = await common.client()
        if force:
            warning = force_warning(await client.describe(job_id), peer=peer, requeue=requeue)
            if warning is not None:
                typer.secho(warning, err=True, fg=typer.colors.YELLOW)
        message = await client.replay_handoff(job_id, peer=peer, requeue=requeue, reason=reason, force=force)
        typer.echo(f"{job_id}: {message}")

    common.run(go())
