"""The secret scan (docs/DESIGN.md, "Where secrets live"; docs/SECURITY.md): every private key in use
(PEM body and raw key bytes in hex, base64 and base64url) and every object-store credential of a
stack, searched for in every workflow history of that stack's Temporal (as Temporal keeps it, in
protobuf: every string and every payload's bytes verbatim), in every
file under the given roots (stack logs, controller state, relayed job logs, other tests' temporary
directories; key files excepted) and in the responses tests collected (``Stack.responses``).

Each stack runs it at its teardown (tests/conftest.py), after every test that used it, so it sees
everything the session produced, in whichever test process it ran; tests/security/
test_security_secret_scan.py adds what a job sees and what the CLI answers.
"""

from __future__ import annotations

import asyncio
import base64
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from stack import Stack
from temporalio.api.history.v1 import History
from temporalio.client import Client, WorkflowHistory
from temporalio.service import RPCError, RPCStatusCode

from iris import devstack
from iris.config import FederationConfig

KEY_SUFFIXES = (".key", ".pub", ".keygen.lock")


def key_needles(key_file: Path) -> dict[str, bytes]:
    pem = key_file.read_bytes()
    body = b"".join(line for line in pem.splitlines() if line and not line.startswith(b"-----"))
    needles = {f"{key_file.name} PEM body": body}
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError):
        return needles
    if isinstance(key, Ed25519PrivateKey):
        raw = key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        needles[f"{key_file.name} raw bytes"] = raw
        needles[f"{key_file.name} raw hex"] = raw.hex().encode()
        needles[f"{key_file.name} raw base64"] = base64.b64encode(raw).rstrip(b"=")
        needles[f"{key_file.name} raw base64url"] = base64.urlsafe_b64encode(raw).rstrip(b"=")
    return needles


def secrets_in_use(config: FederationConfig, roots: list[Path]) -> dict[str, bytes]:
    needles: dict[str, bytes] = {}
    for root in roots:
        for key_file in sorted(root.rglob("*.key")):
            needles.update({f"{key_file.parent.name}/{k}": v for k, v in key_needles(key_file).items()})
    # Every cluster's demo store credentials, by value: each is held only by its cluster's
    # controller (tests/security/test_security_credentials.py), and must surface nowhere.
    for cluster, creds in devstack.all_store_credentials(config).items():
        for name, value in creds.items():
            needles[f"{cluster} ${name}"] = value.encode()
    return needles


def history_bytes(history: WorkflowHistory) -> bytes:
    """A fetched history as Temporal stores it (protobuf): every string and every payload's bytes
    appear verbatim, so a needle in any of them is found without decoding JSON (which cost the
    suite's last test process minutes at teardown)."""
    return History(events=history.events).SerializeToString()


@dataclass
class Scan:
    needles: dict[str, bytes]
    hits: list[str] = field(default_factory=list)
    items: dict[str, int] = field(default_factory=dict)
    volume: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def search(self, kind: str, where: str, data: bytes) -> None:
        self.items[kind] = self.items.get(kind, 0) + 1
        self.volume[kind] = self.volume.get(kind, 0) + len(data)
        for label, needle in self.needles.items():
            if needle in data:
                self.hits.append(f"{label} in {kind} {where}")


async def scan_histories(client: Client, scan: Scan) -> None:
    """Search every workflow history of ``client``'s namespace, 16 fetched at a time."""
    gate = asyncio.Semaphore(16)

    async def one(workflow_id: str, run_id: str | None) -> None:
        async with gate:
            try:
                history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
            except RPCError as exc:
                if exc.status == RPCStatusCode.NOT_FOUND:  # deleted by its test since it was listed
                    return
                raise
        scan.search("history", f"{workflow_id} ({run_id})", history_bytes(history))

    started = time.monotonic()
    runs = [(wf.id, wf.run_id) async for wf in client.list_workflows("")]
    await asyncio.gather(*(one(w, r) for w, r in runs))
    scan.seconds["history"] = time.monotonic() - started


def session_files(root: Path) -> Iterator[Path]:
    """Every regular file under ``root`` the session wrote, in order. Not a FIFO, socket or device
    (reading a FIFO with no writer blocks for ever: CI run O's scan hung on a sandbox test's pipe
    until pytest-timeout), nor a symlink. A Python virtual environment (a directory with
    ``pyvenv.cfg``: the README tests' ``uv tool install`` and project ``.venv``, about 10,000 files
    each) is what a package install put there, and is left out: in CI run N the scan read 58,906
    files in 150 s, four fifths of them in such environments."""
    for here, dirs, files in os.walk(root):
        if "pyvenv.cfg" in files:
            dirs.clear()
            continue
        dirs.sort()
        for name in sorted(files):
            path = Path(here) / name
            try:
                regular = stat.S_ISREG(path.lstat().st_mode)
            except OSError:
                continue  # removed meanwhile
            if regular:
                yield path


def scan_files(roots: list[Path], scan: Scan) -> None:
    started = time.monotonic()
    for root in roots:
        for path in session_files(root):
            if path.name.endswith(KEY_SUFFIXES) or path.suffix == ".tmp":
                continue
            try:
                data = path.read_bytes()
            except OSError:
                continue  # a file removed while scanning (a finished job's scratch space)
            scan.search("file", str(path.relative_to(root)), data)
    scan.seconds["file"] = scan.seconds.get("file", 0.0) + time.monotonic() - started


async def scan_stack(stack: Stack, roots: list[Path]) -> Scan:
    """Search ``stack``'s histories and the responses its tests collected for every secret in use
    under ``roots`` and every store credential of the stack."""
    scan = Scan(secrets_in_use(stack.config, roots))
    assert any("PEM body" in k for k in scan.needles) and any("$" in k for k in scan.needles)
    for i, body in enumerate(stack.responses):
        scan.search("response", f"test response #{i}", body.encode())
    await scan_histories(stack.client, scan)
    return scan


def scan_session_files(config: FederationConfig, roots: list[Path]) -> Scan:
    """Search every file under ``roots`` for every secret in use there and every store credential
    of ``config``'s clusters."""
    scan = Scan(secrets_in_use(config, roots))
    scan_files(roots, scan)
    return scan


def report(scan: Scan) -> str:
    keys = sum("PEM body" in k for k in scan.needles)
    lines = [f"secret scan: {len(scan.needles)} secrets ({keys} private keys)"]
    for kind in ("history", "file", "response"):
        took = f"  in {scan.seconds[kind]:.1f} s" if kind in scan.seconds else ""
        size = scan.volume.get(kind, 0) / 1e6
        lines.append(f"  {kind:<9} {scan.items.get(kind, 0):>6} scanned  {size:8.1f} MB{took}")
    lines.append(f"  hits      {len(scan.hits):>6}")
    return "\n".join(lines)
