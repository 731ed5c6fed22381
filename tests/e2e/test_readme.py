"""The README's examples, run as printed by a new user and compared with what it prints (issue 27;
tests/readme.py says how blocks are named, run and compared).

Each test is a new user: a fresh HOME outside the repository, the README's set-up (the CLI by `uv
tool install --editable`, the SDK by `uv add --editable` in the user's own project), a fresh `iris
dev` as ``alice`` on free ports (``IRIS_CONFIG`` names its config: the one thing the README's
commands do not type), and the README's commands run by bash from a copy of the example's
directory, outside the repository.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import readme
from devprocess import DevProcess
from stack import CliResult, Stack, free_port_config, wait_until

from iris import devstack
from iris.config import load_config
from iris.userauth import USER_KEY_DIR_ENV

UV = os.environ.get("UV") or shutil.which("uv")
PROJECT_ROOT = readme.PROJECT_ROOT
VENV_BIN = Path(sys.executable).parent
USER = "alice"
# Starts of iris dev tried, each on fresh ports (see ``new_user``).
DEV_START_TRIES = 3

pytestmark = [
    pytest.mark.skipif(UV is None, reason="uv is not on PATH (the README's commands need it)"),
    pytest.mark.timeout(600),
]


def _uv_cache_dir() -> str:
    """The machine's uv cache: a new HOME keeps using it (a new user of this machine would too)."""
    assert UV is not None
    return subprocess.run([UV, "cache", "dir"], capture_output=True, text=True, check=True).stdout.strip()


@dataclass
class NewUser:
    """A user with a fresh HOME, after the README's set-up, against their own `iris dev`."""

    home: Path
    env: dict[str, str]
    dev: DevProcess

    async def sh(self, command: str, cwd: Path, timeout: float = 180) -> CliResult:
        """``command`` as bash runs it in ``cwd``, the way the user types it."""
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", command, cwd=cwd, env=self.env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
        return CliResult(proc.returncode or 0, out.decode(), err.decode())

    async def run_block(
        self,
        name: str,
        cwd: Path,
        *,
        before: dict[int, Callable[[], Coroutine[Any, Any, None]]] | None = None,
        paths: dict[str, str] | None = None,
    ) -> Path:
        """Run every command of console block ``name`` from ``cwd`` (``cd DIR`` moves it) and
        check each one's output; ``before[i]`` runs before command ``i`` (e.g. waits for a job the
        README says is running). Returns the directory the block ended in."""
        for i, cmd in enumerate(readme.commands(readme.block(name).text)):
            if before and i in before:
                await before[i]()
            words = shlex.split(cmd.command, comments=True)
            if words[0] == "cd":
                cwd = (cwd / words[1]).resolve()
                continue
            res = await self.sh(cmd.command, cwd)
            here = {str(cwd): "<cwd>", f"{readme.RECORDED_ROOT}/examples/seed": "<cwd>"}
            here[f"{readme.RECORDED_ROOT}/examples/jobfile"] = "<cwd>"
            readme.check_output(cmd, res.stdout, res.stderr, paths={**here, **(paths or {})})
        return cwd


def _user_env(home: Path, config_file: Path) -> dict[str, str]:
    venv = str(VENV_BIN)
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != venv]
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("UV_", "VIRTUAL_ENV", "XDG_", "IRIS_", "PYTEST_", "COV_"))
        and k not in ("UV", "PYTHONPATH")
    }
    env.update(
        HOME=str(home),
        PATH=os.pathsep.join([str(home / ".local" / "bin"), str(Path(UV or "uv").parent), *path]),
        UV_CACHE_DIR=_uv_cache_dir(),
        IRIS_USER=USER,
        IRIS_CONFIG=str(config_file),
    )
    return env


@pytest.fixture
async def new_user(tmp_path: Path) -> AsyncIterator[NewUser]:
    """The README's set-up in a fresh HOME, then `iris dev` (which makes the user's key and copies
    the payload key ring into the user's key directory under that HOME)."""
    home = tmp_path / "home"
    home.mkdir()
    config_file = tmp_path / "dev-config.json"
    env = _user_env(home, config_file)
    user = NewUser(home, env, DevProcess(config_file, tmp_path / "data", user=USER))
    # The set-up: the CLI on PATH (README, "Installing iris"), as the user types it.
    res = await user.sh(_script("install-cli"), home, timeout=600)
    assert res.code == 0, res.stderr
    # iris dev as the user runs it, its keys under that HOME (no key-dir override).
    user.dev.env = {**user.dev.env, "HOME": str(home)}
    user.dev.env.pop(USER_KEY_DIR_ENV, None)
    argv = list(user.dev.argv)
    for attempt in range(1, DEV_START_TRIES + 1):
        # Ports chosen now, not before the minutes of the install: the other test process may take
        # one meanwhile (CI run Y: moto's port, taken between the choice and iris dev's start).
        cfg = free_port_config(load_config(), f"127.0.0.1:{devstack.free_port()}")
        cfg.temporal.task_queue = "iris"
        config_file.write_text(cfg.model_dump_json())
        user.dev.argv = [
            *argv,
            "--worker-metrics", f"127.0.0.1:{devstack.free_port()}",
            "--temporal-metrics-port", str(devstack.free_port()),
        ]  # fmt: skip
        try:
            await user.dev.start()
            break
        except AssertionError:
            # Only a service that exited during start (a port taken after iris dev checked it)
            # is tried again, on fresh ports; iris dev stopped everything it started.
            if attempt == DEV_START_TRIES or not any("during start;" in line for line in user.dev.output):
                raise
            user.dev.output = []
    try:
        yield user
    finally:
        assert await user.dev.stop() == 0


def _copy_example(name: str, into: Path) -> Path:
    dest = into / "examples" / name
    shutil.copytree(PROJECT_ROOT / "examples" / name, dest)
    return dest


def _script(name: str) -> str:
    """A set-up block's commands as one bash script, the checkout's path for the README's."""
    lines = [c.command.replace("/path/to/iris-federation", str(PROJECT_ROOT)) for c in _commands(name)]
    return "set -e\n" + "\n".join(lines)


def _commands(name: str) -> list[readme.Command]:
    return readme.commands(readme.block(name).text)


async def _sdk_project(user: NewUser, parent: Path) -> Path:
    """The user's own project with the SDK added as the README says (README, "Installing iris")."""
    await asyncio.to_thread(parent.mkdir, parents=True)
    res = await user.sh(_script("install-sdk"), parent, timeout=600)
    assert res.code == 0, res.stderr
    project = parent / "my-project"
    assert (project / "pyproject.toml").exists()
    return project


async def test_the_seeds_examples_verbatim_from_a_new_directory(new_user: NewUser, tmp_path: Path) -> None:
    """Acceptance 1: from a new directory outside the repository, the seed's three commands (by the
    installed `iris`) and its SDK snippet (in the user's own project) print what the README says."""
    plain = tmp_path / "work"  # no pyproject here: `uv run iris` is the installed one
    _copy_example("seed", plain)
    assert not (plain / "pyproject.toml").exists() and PROJECT_ROOT not in plain.parents
    await new_user.run_block("seed-examples", plain)

    project = await _sdk_project(new_user, tmp_path / "projects")
    seed = _copy_example("seed", project)
    (sdk,) = _commands("seed-sdk")
    res = await new_user.sh(sdk.command, seed)
    assert res.code == 0, res.stderr  # and no crash at exit (a client left open is closed)
    readme.check_output(sdk, res.stdout, res.stderr)


async def test_the_demo_scenario(new_user: NewUser, tmp_path: Path) -> None:
    seed = _copy_example("seed", tmp_path / "work")

    async def sleeper_runs_and_big_waits_for_it() -> None:
        """What the README's `iris job list` shows: the sleeper running, and big told why it waits."""

        async def settled() -> bool:
            sleeper = await new_user.sh(f"iris job describe {USER}/sleeper", seed)
            big = await new_user.sh(f"iris job describe {USER}/big", seed)
            return "State:          RUNNING" in sleeper.stdout and "full on cw-rno2a" in big.stdout

        await wait_until(settled, timeout=60, interval=0.5, what="alice/sleeper to run and alice/big to wait")

    cmds = _commands("demo")
    listing = next(i for i, c in enumerate(cmds) if c.command == "uv run iris job list")
    await new_user.run_block("demo", seed, before={listing: sleeper_runs_and_big_waits_for_it})


async def test_job_files_and_dry_run(new_user: NewUser, tmp_path: Path) -> None:
    jobfile = _copy_example("jobfile", tmp_path / "work")
    await new_user.run_block("jobfile", jobfile)


async def test_dry_run_with_both_peers_full(new_user: NewUser, tmp_path: Path) -> None:
    jobfile = _copy_example("jobfile", tmp_path / "work")
    await new_user.run_block("queue-setup", jobfile)

    async def three_run_and_three_wait_told_why() -> None:
        async def settled() -> bool:
            running = await new_user.sh("iris job list --state RUNNING -o json", jobfile)
            queued = await new_user.sh("iris job list --state QUEUED_HANDOFF -o json", jobfile)
            full = "full on cw-rno2a, cw-us-east-02a"
            return running.stdout.count('"job_id"') == 3 and queued.stdout.count(full) == 3

        what = "three jobs running and three told why they wait"
        await wait_until(settled, timeout=90, interval=0.5, what=what)

    await new_user.run_block("queue", jobfile, before={0: three_run_and_three_wait_told_why})


async def test_the_sdk_block_runs_as_printed(stack: Stack, tmp_path: Path) -> None:
    """The README's SDK block, verbatim, against the test stack, in a directory of its own (its
    submit ships that directory); it prints the job's end and output, and its cancel of the ended
    job says so instead of raising."""
    sdk = readme.block("sdk")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", sdk.text, cwd=tmp_path, env={**stack.cli_env(), "IRIS_USER": "alice"},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 180)
    assert proc.returncode == 0, err.decode()
    lines = [line for line in out.decode().splitlines() if line]  # the logs end with a newline
    assert lines[0].startswith("SUCCEEDED cw-") and lines[0].endswith(" 42"), lines
    assert lines[1].startswith("[(1, 'cw-") and lines[1].endswith(" 42"), lines
    assert lines[2] == "False", lines  # cancel of an ended job: nothing to cancel
