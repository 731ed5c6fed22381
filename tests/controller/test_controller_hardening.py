"""Controller hardening (issue 16, "Controller and client hardening") against real controller
processes: streamed bodies are capped before authentication, the schema and docs pages are off
unless configured (and then behind auth), submitter patterns match whole labels, and a controller
without auth refuses a non-loopback bind.

Each test attacks one defence and fails when that defence is removed.
"""

from __future__ import annotations

import fcntl
import os
import select
import socket
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from controller_harness import (
    PROJECT_ROOT,
    Controller,
    cluster,
    cpu_backend,
    federation,
    free_port,
    gpu_backend,
    key_auth,
    make_keys,
    request,
    signer_for,
    start_controller,
    write_config,
)
from hypothesis import given
from hypothesis import strategies as st

from iris.bundle import MAX_ARCHIVE_BYTES, pack
from iris.controller.app import MAX_BODY_BYTES
from iris.controller.client import ControllerClient
from iris.controller.errors import PermissionDenied
from iris.controller.identity import TokenSigner, submitter_matches

MIB = 1 << 20
ATTACK_BYTES = 50 * MIB
CHUNK = 32 * 1024


@dataclass
class World:
    config_path: Path
    key_dir: Path
    peer: Controller  # auth on, allowed_submitters = ["*@allowed.example"], docs off (default)
    docpeer: Controller  # auth on, api_docs = true
    open: Controller  # no [clusters.auth], loopback, docs off (default)

    def signer(self) -> TokenSigner:
        return signer_for(self.config_path, "home", self.key_dir)

    def client(self, ctl: Controller) -> ControllerClient:
        return ControllerClient(ctl.url, signer=self.signer(), audience=ctl.cluster)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("hardening")
    key_dir = root / "keys"
    make_keys(key_dir, "home", "peer", "docpeer")
    peer = cluster(
        "peer",
        backends=[gpu_backend()],
        auth=key_auth("peer", trusted_requesters=["home"], allowed_submitters=["*@allowed.example"]),
    )
    docpeer = cluster(
        "docpeer",
        backends=[gpu_backend()],
        auth=key_auth("docpeer", trusted_requesters=["home"], allowed_submitters=["*"]),
    )
    docpeer["api_docs"] = True
    open_peer = cluster("open", backends=[cpu_backend()])
    cfg = write_config(
        root / "clusters.toml",
        federation(cluster("home", auth=key_auth("home")), peer, docpeer, open_peer),
    )
    started: list[Controller] = []
    try:
        for spec, kd in ((peer, key_dir), (docpeer, key_dir), (open_peer, None)):
            name = spec["name"]
            started.append(start_controller(cfg, name, root / name, port=spec["port"], key_dir=kd))
        yield World(cfg, key_dir, *started)
    finally:
        for ctl in started:
            ctl.stop()


# ---- 1. streamed bodies are capped before authentication ------------------------------------------


def _server_rx_queue(server_port: int, client_port: int) -> int | None:
    """Bytes the kernel holds for the server's end of this connection that its process has not
    read yet (``/proc/net/tcp``), or None once that socket is gone."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = fields[1], fields[2]
        if int(local.split(":")[1], 16) == server_port and int(remote.split(":")[1], 16) == client_port:
            return int(fields[4].split(":")[1], 16)
    return None


def _unsent(sock: socket.socket) -> int:
    """Bytes the client's kernel has not yet had acknowledged (SIOCOUTQ)."""
    raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, struct.pack("i", 0))
    value: int = struct.unpack("i", raw)[0]
    return value


@dataclass
class Push:
    sent_before_answer: int  # body bytes the client had sent when the answer came: >= what was read
    status: int | None
    sent_in_all: int  # body bytes sent before the server closed the connection (or all of them)


def push_chunked(port: int, method: str, path: str, total: int = ATTACK_BYTES) -> Push:
    """Send ``total`` bytes as a chunked body without a token, one chunk at a time, each only once
    the server has taken everything sent before (the client's send queue and the server socket's
    receive queue both empty). The bytes sent when the answer arrives bound, from above and to
    within one chunk, what the server read."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    client_port = sock.getsockname()[1]
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()
    frame = f"{CHUNK:x}\r\n".encode() + b"x" * CHUNK + b"\r\n"
    sock.sendall(head)
    sent, answered_at = 0, None

    def answered(wait_s: float) -> bool:
        return bool(select.select([sock], [], [], wait_s)[0])

    try:
        while sent < total:
            if answered_at is None and answered(0):
                answered_at = sent
            try:
                sock.sendall(frame)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += CHUNK
            # Once the chunk that crosses the cap is sent, the answer is due: the server taking the
            # bytes off its socket is not yet its handling them (the last stop's CI: under load, the next
            # chunk went out between the two), so wait for the answer itself, once.
            due = sent == MAX_BODY_BYTES + CHUNK
            deadline = time.monotonic() + 5
            while answered_at is None and time.monotonic() < deadline:
                if answered(0.001):
                    break
                if not due and _unsent(sock) == 0 and not _server_rx_queue(port, client_port):
                    break
        if answered_at is None and answered(5):
            answered_at = sent
        status = None
        if answered_at is not None:
            try:
                first = sock.recv(65536).split(b"\r\n", 1)[0].split()
                status = int(first[1]) if len(first) > 1 else None
            except ConnectionResetError:
                status = None
        return Push(answered_at if answered_at is not None else sent, status, sent)
    finally:
        sock.close()


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/artifacts/check", "/v1/bundles/" + "a" * 64])
def test_a_chunked_body_without_a_token_is_refused_within_1_mib(world: World, path: str) -> None:
    method = "PUT" if path.startswith("/v1/bundles/") else "POST"
    push = push_chunked(world.peer.port, method, path)
    # The server answered (413: body cap; 401: the upload authenticates before it reads), and
    # had read at most the 1 MiB cap plus the one chunk that crossed it.
    assert push.status in (401, 413), push
    assert push.sent_before_answer <= MAX_BODY_BYTES + CHUNK, push
    # ... and then hung up instead of draining the other 49 MiB.
    assert push.sent_in_all < ATTACK_BYTES, push
    assert world.peer.proc.poll() is None


async def test_a_signed_bundle_upload_keeps_its_own_larger_cap(world: World, tmp_path: Path) -> None:
    """The upload route raises the pre-auth cap for a verified caller: a 3 MiB bundle is stored."""
    (tmp_path / "weights.bin").write_bytes(os.urandom(3 * MIB))
    bundle = pack(tmp_path)
    assert bundle is not None and MAX_BODY_BYTES < len(bundle.data) < MAX_ARCHIVE_BYTES
    async with world.client(world.peer) as client:
        info = await client.put_bundle(bundle.ref.sha256, bundle.data)
    assert info.sha256 == bundle.ref.sha256


# ---- 2. no unauthenticated schema or docs pages ---------------------------------------------------


@pytest.mark.parametrize("page", ["/docs", "/redoc", "/openapi.json"])
def test_docs_and_schema_are_off_by_default(world: World, page: str) -> None:
    for ctl in (world.peer, world.open):
        resp = httpx.get(ctl.url + page, timeout=10)
        assert resp.status_code == 404, (ctl.cluster, page, resp.status_code)
        assert resp.json()["code"] == "NOT_FOUND"


@pytest.mark.parametrize("page", ["/docs", "/redoc", "/openapi.json"])
def test_docs_switched_on_need_a_verified_caller(world: World, page: str) -> None:
    url = world.docpeer.url + page
    resp = httpx.get(url, timeout=10)
    assert resp.status_code == 401 and resp.json()["code"] == "UNAUTHENTICATED"
    auth = world.signer().authorization(world.docpeer.cluster, "GET", page)
    resp = httpx.get(url, headers={"Authorization": auth}, timeout=10)
    assert resp.status_code == 200, resp.text
    if page == "/openapi.json":
        assert "/v1/jobs" in resp.json()["paths"]


# ---- 3. submitter patterns match whole labels -----------------------------------------------------

_label = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12)
_domain = st.lists(_label, min_size=1, max_size=4).map(".".join)
_local = st.text(
    alphabet=st.characters(blacklist_characters="@", blacklist_categories=("Cs",)), min_size=1, max_size=20
)


@given(local=_local, domain=_domain, upper=st.booleans())
def test_a_domain_pattern_admits_its_own_domain(local: str, domain: str, upper: bool) -> None:
    user = f"{local}@{domain.upper() if upper else domain}"
    assert submitter_matches([f"*@{domain}"], user)


@given(local=_local, domain=_domain, prefix=_domain, extra=_local)
def test_a_domain_pattern_never_matches_across_an_at_or_a_label(
    local: str, domain: str, prefix: str, extra: str
) -> None:
    pattern = f"*@{domain}"
    # An `@` inside the "local part": two `@`s, refused whatever the pattern.
    smuggled = f"{local}@{prefix}@{domain}"
    assert not submitter_matches([pattern, "*", smuggled], smuggled)
    # A subdomain is another domain: `*` stands for no label.
    assert not submitter_matches([pattern], f"{local}@{prefix}.{domain}")
    # The domain must be the whole domain part, not a suffix of a label.
    assert not submitter_matches([pattern], f"{local}@{extra.replace('@', '')}x{domain}")


@given(user=st.text(max_size=40), pattern_domain=_domain)
def test_a_match_means_exactly_one_at_and_the_same_domain(user: str, pattern_domain: str) -> None:
    if submitter_matches([f"*@{pattern_domain}"], user):
        local, domain = user.split("@")
        assert local and domain.lower() == pattern_domain.lower()


@pytest.mark.parametrize(
    ("user", "admitted"),
    [
        ("alice@allowed.example", True),
        ("ALICE@Allowed.Example", True),
        ("eve@evil.example@allowed.example", False),
        ("eve@evil.allowed.example", False),
        ("eve@notallowed.example", False),
        ("@allowed.example", False),
    ],
)
async def test_the_peer_admits_whole_label_matches_only(world: World, user: str, admitted: bool) -> None:
    req = request(["true"], user=user, requester="home")
    async with world.client(world.peer) as client:
        if admitted:
            assert (await client.launch(req)).job_id == req.job_id
        else:
            with pytest.raises(PermissionDenied, match="may not submit"):
                await client.launch(req)
            assert all(j.job_id != req.job_id for j in await client.list_jobs())


# ---- 4. no unauthenticated controller on a non-loopback bind --------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "example.internal"])
def test_a_controller_without_auth_refuses_a_non_loopback_bind(
    world: World, tmp_path: Path, host: str
) -> None:
    try:
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "iris.controller",
                "--config",
                str(world.config_path),
                "--cluster",
                "open",
                "--state-dir",
                str(tmp_path / "state"),
                "--host",
                host,
                "--port",
                str(free_port()),
            ],
            capture_output=True,
            text=True,
            timeout=20,
            cwd=PROJECT_ROOT,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the controller served {host} without auth")
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [
        f"iris controller: cluster open has no [clusters.auth] section: refusing to serve "
        f"unauthenticated on non-loopback address {host!r} (configure auth, or bind 127.0.0.1)"
    ]
    assert not (tmp_path / "state").exists()


def test_a_controller_without_auth_on_loopback_starts_and_warns_once(world: World) -> None:
    lines = [line for line in world.open.log_text().splitlines() if "unauthenticated" in line]
    assert len(lines) == 1, lines
    assert " WARNING iris.controller: controller open admits every request unauthenticated" in lines[0]
    assert httpx.get(world.open.url + "/v1/health", timeout=5).status_code == 200
