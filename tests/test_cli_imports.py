"""The CLI starts without the SDK's heavy parts (issue 25): `iris --help` and `iris job list --help`
load no Temporal SDK, workflow, activity or SQLAlchemy module, and `iris job list` itself needs the
Temporal client only (cli/common.py, iris/client.py).

Each command runs in a fresh interpreter, through ``cli.app.main`` as the ``iris`` script runs it;
``main`` ends with ``os._exit``, so the wrapper replaces that to write ``sys.modules`` first. No
service is needed: `iris job list` is pointed at a closed port and fails as it would without
Temporal (exit 4), after importing everything its real path imports up to the connection.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

from iris import contract

ROOT = Path(__file__).resolve().parents[1]
# What no job listing needs: the worker, the workflows and activities, and the store's database layer.
FORBIDDEN = ("temporalio.worker", "workflows", "activities", "sqlalchemy")
# A help text needs no Temporal SDK at all.
FORBIDDEN_FOR_HELP = ("temporalio", "workflows", "activities", "sqlalchemy")
MODULES_ENV = "IRIS_TEST_MODULES_FILE"

# `iris ARGS` as the installed script runs it, recording the modules loaded when it exits.
CLI = f"""
import json, os, sys

_exit = os._exit


def _record(code):
    with open(os.environ[{MODULES_ENV!r}], "w") as f:
        json.dump(sorted(sys.modules), f)
    _exit(code)


os._exit = _record
sys.argv = ["iris", *sys.argv[1:]]
from cli.app import main

main()
"""

# The queue positions `iris job list` asks for, sent by a real client of a server that is not there.
POSITIONS = f"""
import asyncio, json, os, sys

from temporalio.client import Client
from iris.temporal import data_converter

from iris.client import AsyncIrisClient, JobSummary
from iris.config import load_config


async def main():
    temporal = await Client.connect(
        os.environ["TEMPORAL_ADDRESS"], lazy=True, data_converter=data_converter()
    )
    client = AsyncIrisClient(temporal, load_config())
    row = JobSummary(
        job_id="alice/queued", state="QUEUED_HANDOFF", peer=None, band=None, device=None,
        user=None, started_at=None, closed=False,
    )
    try:
        await client.with_positions([row])
    except RuntimeError as exc:  # the lazy client connects at its first call: the Update
        print(exc)
    with open(os.environ[{MODULES_ENV!r}], "w") as f:
        json.dump(sorted(sys.modules), f)


asyncio.run(main())
"""


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(code: str, args: Iterable[str], tmp_path: Path) -> tuple[int, str, str, set[str]]:
    """Run ``code`` with ``args`` in a fresh interpreter: exit code, stdout, stderr, modules loaded."""
    modules_file = tmp_path / "modules.json"
    env = {**os.environ, MODULES_ENV: str(modules_file), "TEMPORAL_ADDRESS": f"127.0.0.1:{closed_port()}"}
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert modules_file.exists(), f"exit {proc.returncode} before recording its modules: {proc.stderr}"
    return proc.returncode, proc.stdout, proc.stderr, set(json.loads(modules_file.read_text()))


def loaded(modules: set[str], packages: Iterable[str]) -> list[str]:
    """The modules of ``packages`` (each a package or module name) among ``modules``."""
    return sorted(m for m in modules for p in packages if m == p or m.startswith(p + "."))


@pytest.mark.parametrize("args", [["--help"], ["job", "list", "--help"]], ids=" ".join)
def test_help_loads_no_temporal_workflow_activity_or_sqlalchemy(args: list[str], tmp_path: Path) -> None:
    code, out, err, modules = run(CLI, args, tmp_path)
    assert code == 0, err
    assert "Usage: iris" in out
    assert loaded(modules, FORBIDDEN_FOR_HELP) == []


def test_job_list_loads_the_temporal_client_only(tmp_path: Path) -> None:
    code, out, err, modules = run(CLI, ["job", "list"], tmp_path)
    assert code == 4, (out, err)
    assert err.startswith("error: cannot reach Temporal"), err
    # It got as far as connecting: the client and the SDK's job models are loaded, nothing more.
    assert {"temporalio.client", "iris.client", "iris.jobs"} <= modules
    assert loaded(modules, FORBIDDEN) == []


def test_queue_positions_are_asked_without_the_workflows(tmp_path: Path) -> None:
    """`iris job list` asks the placement manager for the positions of the queued jobs it lists:
    by the Update's name, with no workflow or activity loaded (there is no service here, so the
    Update fails at the connection, once it is sent)."""
    code, out, err, modules = run(POSITIONS, [], tmp_path)
    assert code == 0, err
    assert "Failed client connect" in out
    assert loaded(modules, FORBIDDEN) == []


def test_ops_lists_and_runs_its_command_built_on_demand(tmp_path: Path) -> None:
    """check-determinism (cli/ops.py) is added to `iris ops` when the group is used: listed after
    replay-handoff, with its --query default naming the job workflow."""
    code, out, err, _ = run(CLI, ["ops", "--help"], tmp_path)
    assert code == 0, err
    assert 0 < out.index("replay-handoff") < out.index("check-determinism")
    code, out, err, modules = run(CLI, ["ops", "check-determinism", "--help"], tmp_path)
    assert code == 0, err
    assert contract.JOB_WORKFLOW in out  # [default: WorkflowType = 'JobWorkflow']
    assert "cli.ops" in modules
