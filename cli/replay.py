"""`iris ops replay-handoff`: an operator re-runs a failed handoff
(docs/DESIGN.md, "Replaying a failed handoff")."""

from __future__ import annotations

from typing import Annotated

import typer

from cli import common


def replay_handoff_command(
    job_id: Annotated[str, typer.Argument(help="The job id.")],
    peer: Annotated[str | None, typer.Option("--peer", help="Hand off to this cluster instead.")] = None,
    requeue: Annotated[bool, typer.Option("--requeue", help="Send the job back to the queue.")] = False,
    reason: Annotated[
        str, typer.Option("--reason", help="Recorded in the job's history.")
    ] = "operator replay",
) -> None:
    """Re-run artifact check + handoff for a job parked in HANDOFF_FAILED, or reset a closed
    HANDOFF_REJECTED run to just before its handoff. Refused for jobs in any other state."""

    async def go() -> None:
        client = await common.client()
        message = await client.replay_handoff(job_id, peer=peer, requeue=requeue, reason=reason)
        typer.echo(f"{job_id}: {message}")

    common.run(go())
