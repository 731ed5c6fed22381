"""`iris keys ensure` and `iris keys payload`: the payload key ring is made once, owner-only,
rotated by adding a key, given to a CLI by merging, and never printed (docs/SECURITY.md,
"Payload encryption")."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from iris.keydirs import payload_keyring_file
from iris.payloadcodec import KEYRING_NAME, PAYLOAD_KEYS_ENV, read_keyring
from iris.userauth import USER_KEY_DIR_ENV

IRIS = str(Path(sys.executable).parent / "iris")


def run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in (PAYLOAD_KEYS_ENV, USER_KEY_DIR_ENV)}
    env = {USER_KEY_DIR_ENV: str(tmp_path / "user-keys"), **env}
    return subprocess.run([IRIS, *args], capture_output=True, text=True, env={**clean, **env}, timeout=60)


def material(path: Path) -> list[str]:
    return [line.split()[1] for line in path.read_text().splitlines() if not line.startswith("#")]


def test_ensure_makes_the_ring_once_beside_the_cluster_keys(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    first = run(tmp_path, "keys", "ensure", "--per-cluster", "--dir", str(keys))
    assert first.returncode == 0, first.stderr
    ring = payload_keyring_file(keys)
    assert f"payload key ring: {ring} (created)" in first.stdout
    assert stat.S_IMODE(ring.stat().st_mode) == 0o600 and stat.S_IMODE(ring.parent.stat().st_mode) == 0o700
    before = ring.read_bytes()
    again = run(tmp_path, "keys", "ensure", "--per-cluster", "--dir", str(keys))
    assert again.returncode == 0 and "(created)" not in again.stdout
    assert ring.read_bytes() == before
    # No cluster's directory holds it, and no cluster may be named like its directory.
    assert not any((keys / name / KEYRING_NAME).exists() for name in ("marin", "cw-rno2a", "cw-us-east-02a"))


def test_payload_rotates_installs_and_never_prints_a_key(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    made = run(tmp_path, "keys", "payload", "--dir", str(keys))
    assert made.returncode == 0, made.stderr
    ring_file = payload_keyring_file(keys)
    first = read_keyring(ring_file)
    assert f"created ring: {ring_file}" in made.stdout and f"{first.current}  (current" in made.stdout

    rotated = run(tmp_path, "keys", "payload", "--dir", str(keys), "--rotate", "--install")
    assert rotated.returncode == 0, rotated.stderr
    ring = read_keyring(ring_file)
    assert ring.ids[0] == first.current and len(ring.ids) == 2
    assert f"{ring.current}  (current" in rotated.stdout
    # The CLI's own ring (beside the user key) now holds both, the new one current.
    own = tmp_path / "user-keys" / KEYRING_NAME
    assert read_keyring(own) == ring and stat.S_IMODE(own.stat().st_mode) == 0o600
    for out in (made, rotated):
        assert not any(k in out.stdout + out.stderr for k in material(ring_file))

    # Without --dir or --file: $IRIS_PAYLOAD_KEYS, else the CLI's own ring.
    listed = run(tmp_path, "keys", "payload")
    assert listed.returncode == 0 and f"existing ring: {own}" in listed.stdout
    named = run(tmp_path, "keys", "payload", **{PAYLOAD_KEYS_ENV: str(ring_file)})
    assert f"existing ring: {ring_file}" in named.stdout
    both = run(tmp_path, "keys", "payload", "--dir", str(keys), "--file", str(own))
    assert both.returncode == 2 and "not both" in both.stderr


def test_a_cluster_named_like_the_rings_directory_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "clusters.toml"
    config.write_text(
        (Path(__file__).resolve().parents[1] / "config" / "clusters.toml")
        .read_text()
        .replace('name = "cw-rno2a"', 'name = "payload"')
    )
    res = run(
        tmp_path, "--config", str(config), "keys", "ensure", "--per-cluster", "--dir", str(tmp_path / "k")
    )
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert "payload key ring" in res.stderr
