"""`iris dev` as a newcomer runs it: one command up, jobs run, Ctrl-C leaves nothing, state survives."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import signal
import termios
from pathlib import Path

import httpx
import pytest
from devprocess import DevProcess
from stack import free_port_config, wait_until

from iris import devstack
from iris.config import FederationConfig, load_config
from iris.payloadcodec import PAYLOAD_KEYS_ENV
from iris.userauth import USER_KEY_DIR_ENV


def _pids_mentioning(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            pids.append(int(entry.name))
    return pids


def _ports(cfg: FederationConfig) -> list[int]:
    return [
        int(cfg.temporal.address.rpartition(":")[2]),
        cfg.temporal.ui_port,
        cfg.s3_port,
        cfg.gcs_port,
        *(c.port for c in cfg.clusters),
    ]


@pytest.mark.timeout(400)
async def test_iris_dev_runs_the_stack_stops_cleanly_and_keeps_jobs(tmp_path: Path) -> None:
    cfg = free_port_config(load_config(), f"127.0.0.1:{devstack.free_port()}")
    config_file = tmp_path / "dev-config.json"
    config_file.write_text(cfg.model_dump_json())
    data_dir = tmp_path / "data"
    dev = DevProcess(
        config_file,
        data_dir,
        # Free ports, not the defaults: another stack (a developer's own iris dev) may hold them.
        "--worker-metrics",
        f"127.0.0.1:{devstack.free_port()}",
        "--temporal-metrics-port",
        str(devstack.free_port()),
    )
    await dev.start()
    try:
        text = "".join(dev.output)
        assert f"http://127.0.0.1:{cfg.temporal.ui_port}" in text
        for c in cfg.clusters:
            assert c.url in text
        async with httpx.AsyncClient(timeout=10) as http:
            ui = await http.get(f"http://127.0.0.1:{cfg.temporal.ui_port}/")
            assert ui.status_code == 200

        code, out, err = await dev.iris("job", "run", "--job-name", "hello", "--", "echo", "hello")
        assert code == 0, err
        assert "SUCCEEDED" in err
        code, out, _ = await dev.iris("job", "logs", "newcomer/hello")
        assert out.strip() == "hello"
        code, out, err = await dev.iris(
            "job", "run", "--job-name", "h100", "--target-cluster", "cw-us-east-02a",
            "--device-type", "h100", "--gpu-count", "8", "--", "python", "-c", "print(42)",
        )  # fmt: skip
        assert code == 0, err
        code, out, _ = await dev.iris("job", "describe", "newcomer/h100")
        assert "cw-us-east-02a" in out and "SUCCEEDED" in out
        code, out, err = await dev.iris("job", "run", "--device-type", "tpu-v9", "--", "true")
        assert code == 2 and "rejected" in err
        # A job still running when the stack stops must not outlive it.
        code, out, err = await dev.iris(
            "job", "run", "--no-wait", "--job-name", "long", "--", "sleep", "3171"
        )
        assert code == 0, err

        async def running() -> bool:
            return "RUNNING" in (await dev.iris("job", "describe", "newcomer/long"))[1]

        await wait_until(running, timeout=60, what="the long job to run")
    finally:
        exit_code = await dev.stop()
    assert exit_code == 0, "".join(dev.output)
    assert _pids_mentioning(str(tmp_path)) == []
    assert _pids_mentioning("sleep 3171") == []
    for port in _ports(cfg):
        assert not devstack.port_open("127.0.0.1", port), port

    # Same data directory: the earlier jobs are still there.
    await dev.start()
    try:
        code, out, err = await dev.iris("job", "list")
        assert code == 0, err
        assert "newcomer/hello" in out and "newcomer/h100" in out
        code, out, _ = await dev.iris("job", "logs", "newcomer/hello")
        assert out.strip() == "hello"
    finally:
        assert await dev.stop() == 0
    assert _pids_mentioning(str(tmp_path)) == []


class PtyDev:
    """`uv run iris dev` on a pseudo-terminal of its own, as a user's shell runs it: Ctrl-C there
    reaches the whole foreground process group (`uv` and the `iris dev` it started)."""

    def __init__(self, config_file: Path, data_dir: Path) -> None:
        self.argv = [
            str(UV), "run", "--project", str(PROJECT_ROOT), "--frozen",
            "iris", "--config", str(config_file), "dev", "--data-dir", str(data_dir),
            "--worker-metrics", f"127.0.0.1:{devstack.free_port()}",
            "--temporal-metrics-port", str(devstack.free_port()),
        ]  # fmt: skip
        # Its own user key directory (the ring `iris dev` installs for its CLI goes there), and no
        # ring of this process's: as a user's shell would have it.
        self.env = {**os.environ, USER_KEY_DIR_ENV: str(data_dir.parent / "user-keys")}
        self.env.pop(PAYLOAD_KEYS_ENV, None)
        self.output = bytearray()
        self.proc: asyncio.subprocess.Process | None = None
        self._master = -1

    def _read(self) -> None:
        try:
            self.output += os.read(self._master, 65536)
        except OSError:  # the terminal closed with its last process
            asyncio.get_running_loop().remove_reader(self._master)

    async def start(self) -> None:
        self._master, slave = os.openpty()

        def controlling_terminal() -> None:  # in the child, after setsid (start_new_session)
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=slave, stdout=slave, stderr=slave, cwd=PROJECT_ROOT, env=self.env,
            start_new_session=True, preexec_fn=controlling_terminal,
        )  # fmt: skip
        os.close(slave)
        asyncio.get_running_loop().add_reader(self._master, self._read)

        async def ready() -> bool:
            if self.proc is not None and self.proc.returncode is not None:
                raise AssertionError("iris dev exited during start:\n" + self.output.decode(errors="replace"))
            return b"Ready." in self.output

        await wait_until(ready, timeout=120, interval=0.2, what="iris dev to be ready")

    def ctrl_c(self) -> None:
        os.write(self._master, b"\x03")  # the terminal sends SIGINT to its foreground group

    async def exited(self) -> int:
        assert self.proc is not None
        code = await asyncio.wait_for(self.proc.wait(), 90)
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(self._master)
            os.close(self._master)
        return code


UV = shutil.which("uv")
PROJECT_ROOT = Path(__file__).resolve().parents[2]


async def _started_pty_dev(tmp_path: Path, tries: int = 3) -> tuple[FederationConfig, PtyDev]:
    """`iris dev` started on free ports; again on fresh ones when another test process took one
    of them between its choice and the bind (iris dev then stops with "Address already in use")."""
    for attempt in range(1, tries + 1):
        cfg = free_port_config(load_config(), f"127.0.0.1:{devstack.free_port()}")
        config_file = tmp_path / f"dev-config-{attempt}.json"
        config_file.write_text(cfg.model_dump_json())
        dev = PtyDev(config_file, tmp_path / f"data-{attempt}")
        try:
            await dev.start()
        except AssertionError as exc:
            if attempt == tries or "Address already in use" not in str(exc):
                raise
            continue
        return cfg, dev
    raise AssertionError("unreachable")


@pytest.mark.skipif(UV is None, reason="uv is not on PATH (the README's commands need it)")
@pytest.mark.parametrize("interrupt", ["two-ctrl-c", "group-sigint"])
@pytest.mark.timeout(300)
async def test_iris_dev_leaves_nothing_behind_whatever_signals_arrive(tmp_path: Path, interrupt: str) -> None:
    cfg, dev = await _started_pty_dev(tmp_path)
    assert _pids_mentioning(str(tmp_path))  # its services run (their command lines name the data dir)
    assert dev.proc is not None
    if interrupt == "two-ctrl-c":
        dev.ctrl_c()
        await asyncio.sleep(0.3)  # not a wait: the pause between a user's two Ctrl-C
        dev.ctrl_c()
    else:
        os.killpg(dev.proc.pid, signal.SIGINT)  # e.g. a script stopping the whole group
    await dev.exited()
    leftover = _pids_mentioning(str(tmp_path))
    assert leftover == [], dev.output.decode(errors="replace")
    for port in _ports(cfg):
        assert not devstack.port_open("127.0.0.1", port), port
