"""One key directory per cluster (docs/DESIGN.md, "Where secrets live").

``DIR/<cluster>/`` holds that cluster's own private key and the public keys of every cluster; each
process of a cluster (its controller; for the home cluster also the worker and the CLI) is pointed
at its own directory, so no process can read another cluster's private key. The config's key file
names stay as they are (relative names resolve against the directory a process is given), so one
federation config serves every process.

A pair is created in its cluster's own directory; only the public half is copied to the others.
A flat directory from an earlier layout (``DIR/<cluster>.key``) is moved into place, so a cluster
keeps its identity.

``DIR/payload/payload.keys`` is the federation's payload key ring (iris/payloadcodec.py; docs/SECURITY.md,
"Payload encryption"): the worker's, never a controller's; ``ensure_payload_keys`` creates it.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass, field
from pathlib import Path

from iris.config import ConfigError, FederationConfig
from iris.controller.identity import write_keypair
from iris.payloadcodec import KEYRING_NAME, ensure_keyring

# The payload key ring's directory under a key root, beside the clusters' own directories.
PAYLOAD_DIR = "payload"


@dataclass
class KeyDirs:
    """Each cluster's key directory, and which clusters got a new pair."""

    root: Path
    dirs: dict[str, Path] = field(default_factory=dict)
    created: list[str] = field(default_factory=list)

    def of(self, cluster: str) -> Path:
        return self.dirs[cluster]


def _relative(name: str) -> bool:
    return bool(name) and not Path(name).expanduser().is_absolute()


def _write_if_changed(path: Path, data: bytes) -> None:
    try:
        if path.read_bytes() == data:
            return
    except FileNotFoundError:
        pass
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def provision_key_dirs(config: FederationConfig, root: Path) -> KeyDirs:
    """Create ``root/<cluster>/`` for every cluster whose auth names key files (0700), with its own
    pair (created if absent) and every other cluster's public key. Idempotent; serialized by a lock
    so concurrent starts never read a half-written pair.

    Clusters whose keys are named by environment variables or absolute paths are not managed here:
    their operator places them.
    """
    result = KeyDirs(root)
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".keygen.lock").open("a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        publics: dict[str, bytes] = {}
        for cluster in config.clusters:
            own = root / cluster.name
            own.mkdir(mode=0o700, exist_ok=True)
            os.chmod(own, 0o700)
            result.dirs[cluster.name] = own
            auth = cluster.auth
            if auth is None or not _relative(auth.private_key_file) or not _relative(auth.public_key_file):
                continue
            private, public = own / auth.private_key_file, own / auth.public_key_file
            # The flat layout of earlier versions: keep the cluster's identity, out of shared reach.
            for name in (auth.private_key_file, auth.public_key_file):
                flat = root / name
                if flat.exists() and not (own / name).exists():
                    os.replace(flat, own / name)
            if not private.exists() and not public.exists():
                write_keypair(private, public)
                result.created.append(cluster.name)
            if public.exists():
                publics[public.name] = public.read_bytes()
        for cluster in config.clusters:
            own_public = cluster.auth.public_key_file if cluster.auth is not None else ""
            for name, pem in publics.items():
                if name != own_public:
                    _write_if_changed(result.dirs[cluster.name] / name, pem)
    return result


def payload_keyring_file(root: Path) -> Path:
    """Where the payload key ring of a key root is: ``root/payload/payload.keys``."""
    return root / PAYLOAD_DIR / KEYRING_NAME


def ensure_payload_keys(config: FederationConfig, root: Path) -> tuple[Path, bool]:
    """The payload key ring under ``root`` (0600 in a 0700 directory), created with one key if
    absent; and whether it was created. Its directory is no cluster's (a cluster named like it
    would share it: refused)."""
    if PAYLOAD_DIR in config.cluster_names:
        raise ConfigError(f"a cluster named {PAYLOAD_DIR!r} would share the payload key ring's directory")
    path = payload_keyring_file(root)
    _, created = ensure_keyring(path)
    return path, created
