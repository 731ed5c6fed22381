"""Who holds which secret in a running stack (docs/DESIGN.md, "Where secrets live", "Credentials").

``isolation_violations(stack)`` inspects the real processes: the home worker (this test process:
its environment, its key directory and its config file) and each controller (its
``/proc/<pid>/environ`` and the key directory it was started with). Each holds its own cluster's
private key and object-store credentials, and no other cluster's.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from stack import Stack

from iris import devstack
from iris.controller.identity import KEY_DIR_ENV


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {k: v for k, _, v in pairs}


def _cmdline_option(pid: int, option: str) -> str | None:
    argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
    return argv[argv.index(option) + 1] if option in argv else None


def _is_private_key(data: bytes) -> bool:
    try:
        serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        return False
    return True


def private_key_bytes(stack: Stack) -> dict[str, bytes]:
    """Each cluster's private key, read from its own key directory."""
    keys: dict[str, bytes] = {}
    for c in stack.config.clusters:
        if c.auth is not None and c.auth.private_key_file:
            keys[c.name] = (stack.key_dirs[c.name] / c.auth.private_key_file).read_bytes()
    return keys


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


def _holder_violations(
    who: str, cluster: str, env: dict[str, str], key_dir: Path, extra_files: list[Path], stack: Stack
) -> list[str]:
    found: list[str] = []
    keys = private_key_bytes(stack)
    others = {name: pem for name, pem in keys.items() if name != cluster}
    creds = devstack.all_store_credentials(stack.config)
    foreign = {
        f"{name}:{var}": value for name, c in creds.items() if name != cluster for var, value in c.items()
    }
    for var, value in env.items():
        if "PRIVATE KEY" in value:
            found.append(f"{who}: environment variable {var} holds a private key")
    for label, secret in foreign.items():
        name, _, var = label.partition(":")
        if var in env:
            found.append(f"{who}: environment names {name}'s store credential {var}")
        if any(secret in value for value in env.values()):
            found.append(f"{who}: environment holds {name}'s store credential value ({var})")
    for path in [*_files(key_dir), *extra_files]:
        data = path.read_bytes()
        for name, pem in others.items():
            if pem.strip() in data:
                found.append(f"{who}: {path} holds {name}'s private key")
        if _is_private_key(data) and data != keys.get(cluster):
            found.append(f"{who}: {path} is a private key that is not {cluster}'s own")
        for label, secret in foreign.items():
            if secret.encode() in data:
                found.append(f"{who}: {path} holds {label.partition(':')[0]}'s store credential")
    own = [p for p in _files(key_dir) if _is_private_key(p.read_bytes())]
    if cluster in keys and [p.read_bytes() for p in own] != [keys[cluster]]:
        found.append(f"{who}: {key_dir} holds {len(own)} private key(s), not exactly {cluster}'s own")
    return found


def isolation_violations(stack: Stack) -> list[str]:
    """Every secret a process of ``stack`` holds that is not its own cluster's; [] if none."""
    home = stack.config.home
    found: list[str] = []
    # The home worker runs in this process.
    worker_dir = Path(os.environ[KEY_DIR_ENV])
    if worker_dir.resolve() != stack.key_dirs[home].resolve():
        found.append(f"worker: {KEY_DIR_ENV}={worker_dir} is not {home}'s own key directory")
    found += _holder_violations("worker", home, dict(os.environ), worker_dir, [stack.config_file], stack)
    for c in stack.config.clusters:
        svc = stack.services[f"controller {c.name}"]
        if svc.proc is None or svc.proc.poll() is not None:
            continue  # stopped by a crash test; its successor is checked when it runs
        pid = svc.proc.pid
        env = _environ(pid)
        key_dir = _cmdline_option(pid, "--key-dir") or env.get(KEY_DIR_ENV)
        if key_dir is None:
            found.append(f"controller {c.name}: started without a key directory")
            continue
        found += _holder_violations(f"controller {c.name}", c.name, env, Path(key_dir), [], stack)
        mine = devstack.store_credentials(stack.config, c.name)
        if any(env.get(var) != value for var, value in mine.items()):
            found.append(f"controller {c.name}: lacks its own store credentials")
    return found
