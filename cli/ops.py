"""`iris ops ...`: operator tools (SPEC §9)."""

from __future__ import annotations

import typer

from cli.replay import replay_handoff_command

ops_app = typer.Typer(help="Operator tools: replay failed handoffs, check determinism.", no_args_is_help=True)
ops_app.command("replay-handoff")(replay_handoff_command)
