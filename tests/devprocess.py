"""`iris dev` in a subprocess, as a user runs it (tests/e2e/test_dev.py, tests/e2e/test_metrics.py)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from stack import VENV_BIN

from iris.userauth import USER_KEY_DIR_ENV


class DevProcess:
    """``iris --config FILE dev --data-dir DIR EXTRA...`` run by ``user``, whose key `iris dev`
    creates and registers (admin) on first start, in a key directory beside the data directory."""

    def __init__(self, config_file: Path, data_dir: Path, *extra: str, user: str = "newcomer") -> None:
        self.config_file = config_file
        self.argv = [
            str(VENV_BIN / "iris"), "--config", str(config_file), "dev", "--data-dir", str(data_dir), *extra,
        ]  # fmt: skip
        self.env = {**os.environ, "IRIS_USER": user, USER_KEY_DIR_ENV: str(data_dir.parent / "user-keys")}
        self.proc: asyncio.subprocess.Process | None = None
        self.output: list[str] = []

    async def start(self, within_s: float = 180) -> None:
        """Start it and read its output until it says ``Ready.``."""
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=self.env
        )
        assert self.proc.stdout is not None
        async with asyncio.timeout(within_s):
            while True:
                line = (await self.proc.stdout.readline()).decode()
                if not line:
                    raise AssertionError("iris dev exited during start:\n" + "".join(self.output))
                self.output.append(line)
                if line.startswith("Ready."):
                    return

    async def stop(self) -> int:
        """Ctrl-C, as a user stops it; its exit code (that of an earlier exit if it is gone)."""
        if self.proc is None or self.proc.returncode is not None:
            return self.proc.returncode if self.proc is not None else 0
        assert self.proc.stdout is not None
        self.proc.send_signal(signal.SIGINT)
        rest = await asyncio.wait_for(self.proc.stdout.read(), 90)
        self.output.append(rest.decode())
        return await asyncio.wait_for(self.proc.wait(), 30)

    async def iris(self, *args: str, cwd: Path | None = None) -> tuple[int, str, str]:
        """Another `iris` command against it (in ``cwd``, the workspace a job run ships): exit code,
        stdout, stderr."""
        proc = await asyncio.create_subprocess_exec(
            str(VENV_BIN / "iris"), *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=cwd,
            env={**self.env, "IRIS_CONFIG": str(self.config_file)},
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 150)
        return proc.returncode or 0, out.decode(), err.decode()
