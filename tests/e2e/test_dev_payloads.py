"""`iris dev` keeps a job's secrets out of its files (issue 26; docs/SECURITY.md, "Payload
encryption"): alice's `--env` value is in no file of the data directory but the controller's own
0600 store, not in `temporal workflow show` without the codec, and `iris job describe` still
shows the job; the codec server decodes for whoever holds its token; every file of the data
directory is owner-only."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from devprocess import DevProcess
from served import served
from stack import VENV_BIN, free_port_config

from iris import devstack
from iris.codecserver import create_app
from iris.config import load_config
from iris.payloadcodec import ENCODING, KEYRING_NAME, PAYLOAD_KEYS_ENV, read_keyring
from iris.userauth import USER_KEY_DIR_ENV

SECRET = "hunter2-alice"
JOB = "alice/secret"
# The controller's store keeps every job's env to launch it (0600, its user's only: docs/DESIGN.md,
# "Job → controller"); nothing else under the data directory may hold the value.
CONTROLLER_STORE = "controller.db"


def files_holding(root: Path, needle: bytes) -> list[Path]:
    found = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            with contextlib.suppress(OSError):
                if needle in path.read_bytes():
                    found.append(path)
    return found


def open_files(root: Path) -> list[str]:
    """Every file or directory under ``root`` that another user could read, unless it sits in a
    directory only its owner can open (0700) or search-only for others (0711: a controller's state
    directory, whose job directories are each 0700 and their job's own)."""
    found = []
    for path in [root, *root.rglob("*")]:
        if path.is_symlink() or not path.exists():
            continue
        mode = stat.S_IMODE(path.lstat().st_mode)
        parent = stat.S_IMODE(path.parent.lstat().st_mode)
        if path == root:
            if mode & 0o077:
                found.append(f"{path} {oct(mode)}")
        elif mode & 0o077 and parent & 0o077 and not (path.is_dir() and mode & 0o066 == 0):
            found.append(f"{path} {oct(mode)} in {oct(parent)}")
    return found


async def temporal(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        str(VENV_BIN / "temporal"), *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(errors="replace")


async def iris_without_keys(dev: DevProcess, key_dir: Path, *args: str) -> tuple[int, str, str]:
    """`iris ARGS` as another shell of the same user would run it, without any payload key ring."""
    env = {**dev.env, "IRIS_CONFIG": str(dev.config_file), USER_KEY_DIR_ENV: str(key_dir)}
    env.pop(PAYLOAD_KEYS_ENV, None)
    proc = await asyncio.create_subprocess_exec(
        str(VENV_BIN / "iris"), *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 150)
    return proc.returncode or 0, out.decode(), err.decode()


@pytest.fixture(scope="module")
async def dev(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[DevProcess]:
    root = tmp_path_factory.mktemp("dev-payloads")
    cfg = free_port_config(load_config(), f"127.0.0.1:{devstack.free_port()}")
    config_file = root / "dev-config.json"
    config_file.write_text(cfg.model_dump_json())
    dev = DevProcess(
        config_file,
        root / "data",
        "--worker-metrics", f"127.0.0.1:{devstack.free_port()}",
        "--temporal-metrics-port", str(devstack.free_port()),
        user="alice",
    )  # fmt: skip
    await dev.start()
    try:
        yield dev
    finally:
        assert await dev.stop() == 0, "".join(dev.output)


@pytest.mark.timeout(400)
async def test_alices_env_value_is_in_no_history_log_or_database(dev: DevProcess) -> None:
    data_dir = Path(dev.argv[dev.argv.index("--data-dir") + 1])
    cfg = load_config(dev.config_file)
    code, _, err = await dev.iris(
        "job", "run", "--job-name", "secret", "--no-workdir", "--env", f"SECRET_TOKEN_ALICE={SECRET}",
        "--", "sh", "-c", 'echo "length ${#SECRET_TOKEN_ALICE}"',
    )  # fmt: skip
    assert code == 0 and "SUCCEEDED" in err, err
    # The job got the value (it prints only its length).
    code, out, err = await dev.iris("job", "logs", JOB)
    assert out.strip() == f"length {len(SECRET)}", err
    # The owner's CLI reads the job as before, env included (its ring decrypts the history).
    code, out, err = await dev.iris("job", "describe", JOB)
    assert code == 0 and "SUCCEEDED" in out and JOB in out, err
    code, out, err = await dev.iris("job", "describe", JOB, "--json")
    assert code == 0, err
    assert json.loads(out)["spec"]["env"] == {"SECRET_TOKEN_ALICE": SECRET}

    # A CLI without the ring says which key it lacks, in one line, and shows nothing of the job.
    code, out, err = await iris_without_keys(dev, data_dir.parent / "no-keys", "job", "describe", JOB)
    assert code == 2 and err.startswith("error: a payload is encrypted with key"), (out, err)
    assert SECRET not in out + err and len(err.splitlines()) == 1

    # Temporal's own CLI, without the codec: the history is there, its payloads are ciphertext.
    address = ["--address", cfg.temporal.address, "--namespace", cfg.temporal.namespace]
    code, shown = await temporal("workflow", "show", "-w", JOB, *address)
    assert code == 0 and "WorkflowExecutionStarted" in shown, shown
    assert SECRET not in shown and "SECRET_TOKEN_ALICE" not in shown
    code, as_json = await temporal("workflow", "show", "-w", JOB, "--output", "json", *address)
    assert code == 0 and base64.b64encode(ENCODING).decode() in as_json and SECRET not in as_json
    code, described = await temporal("workflow", "describe", "-w", JOB, *address)
    assert code == 0 and SECRET not in described

    # No file of the data directory holds it but the controller's own store, 0600.
    holders = files_holding(data_dir, SECRET.encode())
    assert [p for p in holders if not p.name.startswith(CONTROLLER_STORE)] == []
    for path in holders:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert (data_dir / "temporal.db").exists() and (data_dir / "federation.db").exists()

    # The codec server, with the same ring, decodes for the holder of its token only.
    ring = read_keyring(Path(dev.env["IRIS_USER_KEY_DIR"]) / KEYRING_NAME)
    token = "codec-token-of-the-e2e-test"
    port = devstack.free_port()
    async with served(create_app(ring, token, ["http://localhost:8233"]), port):
        endpoint = ["--codec-endpoint", f"http://127.0.0.1:{port}"]
        code, decoded = await temporal(
            "workflow", "show", "-w", JOB, *address, *endpoint, "--codec-auth", f"Bearer {token}"
        )
        assert code == 0 and SECRET in decoded, decoded
        code, refused = await temporal(
            "workflow", "show", "-w", JOB, *address, *endpoint, "--codec-auth", "Bearer wrong"
        )
        assert SECRET not in refused


@pytest.mark.timeout(400)
async def test_every_file_of_a_running_dev_data_dir_is_owner_only(dev: DevProcess) -> None:
    data_dir = Path(dev.argv[dev.argv.index("--data-dir") + 1])
    code, _, err = await dev.iris("job", "run", "--job-name", "files", "--no-workdir", "--", "echo", "hi")
    assert code == 0, err
    assert owner_only_layout(data_dir) == []
    assert open_files(data_dir) == []


def owner_only_layout(data_dir: Path) -> list[str]:
    """The data directory 0700; its databases, logs and payload key ring 0600."""
    wanted = {data_dir: 0o700, data_dir / "keys" / "payload" / KEYRING_NAME: 0o600}
    wanted |= {data_dir / name: 0o600 for name in ("temporal.db", "federation.db")}
    logs = sorted((data_dir / "logs").iterdir())
    wanted |= dict.fromkeys(logs, 0o600)
    found = [
        f"{p} {oct(stat.S_IMODE(p.stat().st_mode))}"
        for p, m in wanted.items()
        if stat.S_IMODE(p.stat().st_mode) != m
    ]
    return found if logs else ["no logs", *found]
