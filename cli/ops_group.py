"""The `iris ops` group (docs/DESIGN.md, "Operations"), without its heavy command.

`iris ops check-determinism` (cli/ops.py) imports the worker's workflows to replay them, and its
``--query`` default names a workflow type (iris/contract.py, which loads the Temporal SDK). It is
built when `iris ops` lists or runs its commands, so `iris --help` loads neither
(tests/test_cli_imports.py).
"""

from __future__ import annotations

import typer
from typer._click import Command, Context
from typer.core import TyperGroup

from cli.replay import replay_handoff_command

CHECK_DETERMINISM = "check-determinism"


class OpsGroup(TyperGroup):
    """Adds `check-determinism` to the group the first time a command of it is looked up."""

    def _load(self) -> None:
        if CHECK_DETERMINISM not in self.commands:
            from cli.ops import determinism_app

            self.add_command(typer.main.get_command(determinism_app), CHECK_DETERMINISM)

    def list_commands(self, ctx: Context) -> list[str]:
        self._load()
        return super().list_commands(ctx)

    def get_command(self, ctx: Context, cmd_name: str) -> Command | None:
        self._load()
        return super().get_command(ctx, cmd_name)


ops_app = typer.Typer(
    rich_markup_mode=None,
    cls=OpsGroup,
    help="Operator tools: replay failed handoffs, check determinism.",
    no_args_is_help=True,
)
ops_app.command("replay-handoff")(replay_handoff_command)
