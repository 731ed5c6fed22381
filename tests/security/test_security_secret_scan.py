"""No credential crosses clusters or leaks (docs/DESIGN.md, "Where secrets live",
"6. No credential crosses clusters; no unauthenticated or disallowed handoff is admitted"): a scan
of everything the session produced.

Runs last in the session (marker ``scan_last``): every workflow history in the session's Temporal
(payloads decoded), every file the session wrote (stack logs, controller state, relayed job logs,
other tests' temporary directories; key files excepted) and the responses the security tests and
the CLI produced, searched for every private key in use (PEM body and raw key bytes in hex, base64
and base64url) and for the object-store credentials of the stack: 0 hits.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from security_support import Responses
from stack import Stack
from temporalio.service import RPCError, RPCStatusCode

from iris import devstack
from iris.jobs import JobState

pytestmark = pytest.mark.scan_last

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
        needles[f"{key_file.name} raw hex"] = raw.hex().encode()
        needles[f"{key_file.name} raw base64"] = base64.b64encode(raw).rstrip(b"=")
        needles[f"{key_file.name} raw base64url"] = base64.urlsafe_b64encode(raw).rstrip(b"=")
    return needles


def secrets_in_use(stack: Stack, roots: list[Path]) -> dict[str, bytes]:
    needles: dict[str, bytes] = {}
    for root in roots:
        for key_file in sorted(root.rglob("*.key")):
            needles.update({f"{key_file.parent.name}/{k}": v for k, v in key_needles(key_file).items()})
    # Every cluster's demo store credentials, by value: each is held only by its cluster's
    # controller (tests/security/test_security_credentials.py), and must surface nowhere.
    for cluster, creds in devstack.all_store_credentials(stack.config).items():
        for name, value in creds.items():
            needles[f"{cluster} ${name}"] = value.encode()
    return needles


def decoded(value: Any) -> Iterator[bytes]:
    """Every string in a history's JSON, plus the decoded bytes of every payload."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k == "data" and isinstance(v, str):
                try:
                    payload: bytes | None = base64.b64decode(v, validate=True)
                except (binascii.Error, ValueError):
                    payload = None
                if payload is not None:
                    yield payload
            yield from decoded(v)
    elif isinstance(value, list):
        for v in value:
            yield from decoded(v)
    elif isinstance(value, str):
        yield value.encode("utf-8", "surrogateescape")


@dataclass
class Scan:
    needles: dict[str, bytes]
    hits: list[str] = field(default_factory=list)
    items: dict[str, int] = field(default_factory=dict)
    volume: dict[str, int] = field(default_factory=dict)

    def search(self, kind: str, where: str, data: bytes) -> None:
        self.items[kind] = self.items.get(kind, 0) + 1
        self.volume[kind] = self.volume.get(kind, 0) + len(data)
        for label, needle in self.needles.items():
            if needle in data:
                self.hits.append(f"{label} in {kind} {where}")


async def scan_histories(stack: Stack, scan: Scan) -> None:
    gate = asyncio.Semaphore(16)

    async def one(workflow_id: str, run_id: str | None) -> None:
        async with gate:
            try:
                history = await stack.client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
            except RPCError as exc:
                if exc.status == RPCStatusCode.NOT_FOUND:  # deleted by its test since it was listed
                    return
                raise
        blob = b"\n".join([json.dumps(history.to_json_dict()).encode(), *decoded(history.to_json_dict())])
        scan.search("history", f"{workflow_id} ({run_id})", blob)

    runs = [(wf.id, wf.run_id) async for wf in stack.client.list_workflows("")]
    await asyncio.gather(*(one(w, r) for w, r in runs))


def scan_files(roots: list[Path], scan: Scan) -> None:
    for root in roots:
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            if path.name.endswith(KEY_SUFFIXES) or path.suffix == ".tmp":
                continue
            try:
                data = path.read_bytes()
            except OSError:
                continue  # a file removed while scanning (a finished job's scratch space)
            scan.search("file", str(path.relative_to(root)), data)


async def env_dump_jobs(stack: Stack) -> list[str]:
    """One job per cluster that prints its whole environment: what a job could steal."""
    dump = ["sh", "-c", "env; echo ---; cat /proc/self/environ | tr '\\0' '\\n'"]
    ids = [
        await stack.iris.submit(dump, name=f"secret-scan-env-{cluster}", target_cluster=cluster)
        for cluster in stack.config.cluster_names
    ]
    for job_id in ids:
        assert (await stack.iris.wait(job_id, timeout_s=90)).state is JobState.SUCCEEDED
    return ids


async def test_no_private_key_or_object_store_secret_appears_anywhere(
    stack: Stack, responses: Responses, tmp_path_factory: pytest.TempPathFactory
) -> None:
    session_root = tmp_path_factory.getbasetemp()
    roots = [session_root]
    needles = secrets_in_use(stack, roots)
    assert any("PEM body" in k for k in needles) and any("$" in k for k in needles), needles.keys()
    scan = Scan(needles)

    # What a job sees of its cluster's environment, and what users get back from the CLI.
    jobs = await env_dump_jobs(stack)
    secret_names = [
        *(name for creds in devstack.all_store_credentials(stack.config).values() for name in creds),
        "IRIS_KEY_DIR",
    ]
    for job_id in jobs:
        logs = await stack.cli("job", "logs", job_id)
        assert logs.code == 0 and "IRIS_JOB_ID=" in logs.stdout, logs.stderr
        leaked = [name for name in secret_names if f"{name}=" in logs.stdout]
        assert not leaked, f"{job_id} saw the controller's credentials: {leaked}"
        for args in (
            ("job", "logs", job_id),
            ("job", "describe", job_id),
            ("job", "describe", "--json", job_id),
        ):
            res = await stack.cli(*args)
            scan.search("response", " ".join(args), (res.stdout + res.stderr).encode())
    listings: list[tuple[str, ...]] = [
        ("job", "list", "--json"),
        ("peers",),
        ("rpc", "controller", "list-peers"),
    ]
    for listing in listings:
        res = await stack.cli(*listing)
        assert res.code == 0, res.stderr
        scan.search("response", " ".join(listing), (res.stdout + res.stderr).encode())
    for i, body in enumerate(responses.bodies):
        scan.search("response", f"security test response #{i}", body.encode())

    await scan_histories(stack, scan)
    await asyncio.to_thread(scan_files, roots, scan)

    print(f"\nsecret scan: {len(needles)} secrets ({sum('PEM body' in k for k in needles)} private keys)")
    for kind in ("history", "file", "response"):
        print(f"  {kind:<9} {scan.items.get(kind, 0):>6} scanned  {scan.volume.get(kind, 0) / 1e6:8.1f} MB")
    print(f"  hits      {len(scan.hits):>6}")
    assert scan.items.get("history", 0) > 0 and scan.items.get("file", 0) > 0
    assert scan.hits == [], "\n".join(scan.hits[:50])
