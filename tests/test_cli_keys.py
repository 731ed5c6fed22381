"""`iris keys`: generate never overwrites; ensure creates what the config names."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

IRIS = str(Path(sys.executable).parent / "iris")


def run(*args: str, key_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "IRIS_KEY_DIR": str(key_dir)}
    return subprocess.run([IRIS, *args], capture_output=True, text=True, env=env, timeout=60)


def test_generate_writes_an_owner_only_private_key_and_never_overwrites(tmp_path: Path) -> None:
    first = run("keys", "generate", "marin", key_dir=tmp_path)
    assert first.returncode == 0, first.stderr
    key = tmp_path / "marin.key"
    assert key.stat().st_mode & 0o077 == 0
    before = key.read_bytes()
    second = run("keys", "generate", "marin", key_dir=tmp_path)
    assert second.returncode == 2
    assert second.stderr.strip().splitlines() == [f"error: {key} already exists; not overwriting a key"]
    assert key.read_bytes() == before
    assert b"PRIVATE KEY" not in (first.stdout + first.stderr).encode()


def test_ensure_creates_every_configured_key_once(tmp_path: Path) -> None:
    res = run("keys", "ensure", key_dir=tmp_path)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in tmp_path.glob("*.key")) == [
        "cw-rno2a.key",
        "cw-us-east-02a.key",
        "marin.key",
    ]
    again = run("keys", "ensure", key_dir=tmp_path)
    assert "all keys present" in again.stdout
