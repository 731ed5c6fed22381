"""Identity and admission (docs/DESIGN.md, "Handoff and admission"; issue 4 item 4) against real
controller processes.

Each refusal has a test that passes only while its check is in place.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import sqlite3
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from controller_harness import (
    Controller,
    HeldRequest,
    cluster,
    federation,
    free_port,
    gpu_backend,
    key_auth,
    make_keys,
    poll,
    py,
    request,
    restart,
    signer_for,
    start_controller,
    wait_terminal,
    write_config,
)
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from signing import SignerAuth, Token

from iris.bundle import pack
from iris.config import load_config
from iris.controller.client import ControllerClient
from iris.controller.errors import AlreadyExists, NotFound, PermissionDenied, Unauthenticated
from iris.controller.identity import TokenSigner, load_private_key, submitter_matches
from iris.controller.models import ControllerJobState as S
from iris.controller.state import StateStore, now_ms


@dataclass
class AuthWorld:
    config_path: Path
    key_dir: Path
    peer: Controller
    closed: Controller

    def signer(self, name: str) -> TokenSigner:
        return signer_for(self.config_path, name, self.key_dir)

    def key(self, name: str) -> Ed25519PrivateKey:
        return load_private_key(load_config(self.config_path).cluster(name), self.key_dir)

    def client(self, name: str | None, ctl: Controller | None = None) -> ControllerClient:
        return (ctl or self.peer).client(self.signer(name) if name else None)

    def token(self, signer: str = "home", *, audience: str = "peer", **overrides: Any) -> Token:
        """Claims of ``iss`` (default home) signed with ``signer``'s key, bound to the request they
        are sent with unless overridden."""
        iss = overrides.pop("iss", "home")
        return Token(self.key(signer), iss=iss, audience=audience, **overrides)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthWorld]:
    root = tmp_path_factory.mktemp("auth")
    key_dir = root / "keys"
    make_keys(key_dir, "home", "other", "stranger", "ops", "peer", "closed")
    peer = cluster(
        "peer",
        backends=[gpu_backend()],
        auth=key_auth(
            "peer",
            trusted_requesters=["home", "other"],
            admins=["ops"],
            allowed_submitters=["*@Example.com", "bob"],
        ),
    )
    closed = cluster(
        "closed",
        backends=[gpu_backend()],
        auth=key_auth("closed", trusted_requesters=["home"], allowed_submitters=[]),
    )
    cfg = write_config(
        root / "clusters.toml",
        federation(
            cluster("home", auth=key_auth("home")),
            cluster("other", auth=key_auth("other")),
            cluster("stranger", auth=key_auth("stranger")),
            cluster("ops", auth=key_auth("ops")),
            peer,
            closed,
        ),
    )
    peer_ctl = start_controller(cfg, "peer", root / "peer", port=peer["port"], key_dir=key_dir)
    closed_ctl = start_controller(cfg, "closed", root / "closed", port=closed["port"], key_dir=key_dir)
    try:
        yield AuthWorld(cfg, key_dir, peer_ctl, closed_ctl)
    finally:
        peer_ctl.stop()
        closed_ctl.stop()


async def raw(
    ctl: Controller, method: str, path: str, auth: str | Token | None, body: Any = None
) -> httpx.Response:
    """Send one request; a ``str`` is sent as the bearer token as is."""
    headers = {"Authorization": f"Bearer {auth}"} if isinstance(auth, str) else {}
    async with httpx.AsyncClient(base_url=ctl.url, timeout=10) as http:
        if isinstance(auth, Token):
            return await http.request(method, path, json=body, auth=auth)
        return await http.request(method, path, headers=headers, json=body)


def launch_body(**kw: Any) -> dict[str, Any]:
    return request(["true"], **kw).model_dump(mode="json")


# ---- authentication ------------------------------------------------------------------------------


async def test_health_is_open_everything_else_needs_a_token(world: AuthWorld) -> None:
    async with world.client(None) as c:
        assert (await c.health()).cluster == "peer"
        for call in (c.backends(), c.list_jobs(), c.status("a/b"), c.launch(request(["true"]))):
            with pytest.raises(Unauthenticated):
                await call
    for header in ("Basic abc", "Bearer", "Bearer not.a.jwt"):
        async with httpx.AsyncClient(base_url=world.peer.url) as http:
            resp = await http.get("/v1/backends", headers={"Authorization": header})
        assert resp.status_code == 401 and resp.json()["code"] == "UNAUTHENTICATED"


async def test_valid_signature_is_accepted(world: AuthWorld) -> None:
    resp = await raw(world.peer, "GET", "/v1/backends", world.token())
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize(
    ("case", "signer", "overrides"),
    [
        ("forged: claims home, signed by stranger's key", "stranger", {}),
        ("untrusted issuer with its own key", "stranger", {"iss": "stranger", "sub": "stranger"}),
        ("unknown issuer", "home", {"iss": "nobody", "sub": "nobody"}),
        ("wrong audience", "home", {"aud": "someone-else"}),
        ("the old shared audience", "home", {"aud": "federation"}),
        ("addressed to another cluster", "home", {"aud": "closed"}),
        ("several audiences", "home", {"aud": ["peer", "closed"]}),
        ("signed for another method", "home", {"htm": "GET"}),
        ("signed for another path", "home", {"htp": "/v1/backends"}),
        ("signed for another body", "home", {"bsh": hashlib.sha256(b"{}").hexdigest()}),
        ("no method claim", "home", {"htm": None}),
        ("no path claim", "home", {"htp": None}),
        ("no body claim", "home", {"bsh": None}),
        ("subject differs from issuer", "home", {"sub": "other"}),
        ("lifetime over 5 minutes", "home", {"exp": int(time.time()) + 400, "iat": int(time.time())}),
        ("expired", "home", {"iat": int(time.time()) - 200, "exp": int(time.time()) - 100}),
        ("no jti", "home", {"jti": None}),
        ("no exp", "home", {"exp": None}),
        ("no iat", "home", {"iat": None}),
    ],
)
async def test_bad_tokens_are_unauthenticated(
    world: AuthWorld, case: str, signer: str, overrides: dict[str, Any]
) -> None:
    resp = await raw(world.peer, "POST", "/v1/jobs", world.token(signer, **overrides), launch_body())
    assert resp.status_code == 401, f"{case}: {resp.text}"
    assert resp.json()["code"] == "UNAUTHENTICATED"


async def test_token_signed_with_another_algorithm_is_refused(world: AuthWorld) -> None:
    # HS256 keyed with the (public) key text: the classic algorithm-confusion forgery.
    # PyJWT refuses to mint it, so it is assembled by hand.
    pub = (world.key_dir / "home.pub").read_bytes()

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    claims = world.token().bound(httpx.Request("GET", world.peer.url + "/v1/backends"))
    signing_input = (
        b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode()) + "." + b64(json.dumps(claims).encode())
    )
    token = signing_input + "." + b64(hmac.new(pub, signing_input.encode(), hashlib.sha256).digest())
    for alg_none in (signing_input + ".", b64(b'{"alg":"none"}') + "." + signing_input.split(".")[1] + "."):
        assert (await raw(world.peer, "GET", "/v1/backends", alg_none)).status_code == 401
    resp = await raw(world.peer, "GET", "/v1/backends", token)
    assert resp.status_code == 401


async def test_replayed_token_is_refused(world: AuthWorld) -> None:
    token = world.token()  # the same claims for the same request: the same JWT, verbatim
    assert (await raw(world.peer, "GET", "/v1/backends", token)).status_code == 200
    again = await raw(world.peer, "GET", "/v1/backends", token)
    assert again.status_code == 401 and "replayed" in again.json()["message"]


# ---- bound tokens (issue 16): a captured token opens nothing but the request it was signed for -----


async def test_a_token_captured_at_one_cluster_is_refused_at_another(world: AuthWorld) -> None:
    """``closed`` and ``peer`` both trust home. A request home really sent to ``closed``, replayed
    verbatim at ``peer`` (aud names the target cluster), is refused."""
    captured: list[str] = []
    async with httpx.AsyncClient(base_url=world.closed.url, timeout=10) as http:
        sent = await http.get("/v1/backends", auth=SignerAuth(world.signer("home"), "closed", captured))
    assert sent.status_code == 200, sent.text
    resp = await raw(world.peer, "GET", "/v1/backends", captured[0])
    assert resp.status_code == 401, resp.text
    assert "not addressed to cluster peer" in resp.json()["message"]


async def test_a_token_signed_for_one_body_is_refused_with_another(world: AuthWorld) -> None:
    """A handoff intercepted before it arrived, its body swapped: refused, and nothing runs."""
    job_id = f"home/bound-body-{uuid.uuid4().hex[:6]}"
    good = launch_body(job_id=job_id)
    evil = {**good, "command": ["sh", "-c", "echo pwned"]}
    signed_body = httpx.Request("POST", world.peer.url + "/v1/jobs", json=good).content
    token = world.signer("home").token("peer", "POST", "/v1/jobs", signed_body)
    resp = await raw(world.peer, "POST", "/v1/jobs", token, evil)
    assert resp.status_code == 401, resp.text
    assert "another request body" in resp.json()["message"]
    async with world.client("home") as c:
        with pytest.raises(NotFound):
            await c.status(job_id)
    # The token was refused before its jti was spent: the request it was signed for still goes.
    assert (await raw(world.peer, "POST", "/v1/jobs", token, good)).status_code == 200


SHA = hashlib.sha256(b"not a bundle").hexdigest()


@pytest.mark.parametrize(
    ("signed", "sent", "message"),
    [
        (("GET", "/v1/jobs/home/some-job"), ("GET", "/v1/backends"), "another path"),
        (("GET", f"/v1/bundles/{SHA}"), ("PUT", f"/v1/bundles/{SHA}"), "another method"),
        (("GET", "/v1/jobs"), ("POST", "/v1/jobs"), "another method"),
        # A fenced terminate (only attempt 1's run) turned into an unfenced one.
        (
            ("POST", "/v1/jobs/home/some-job/terminate?nonce=home%2Fsome-job%401"),
            ("POST", "/v1/jobs/home/some-job/terminate"),
            "another path or query",
        ),
        (
            ("GET", "/v1/jobs/home/some-job/logs?offset=0"),
            ("GET", "/v1/jobs/home/some-job/logs?offset=0&follow=true&wait_s=60"),
            "another path or query",
        ),
    ],
    ids=["path", "method-put", "method-post", "query-dropped", "query-added"],
)
async def test_a_token_signed_for_one_request_is_refused_for_another(
    world: AuthWorld, signed: tuple[str, str], sent: tuple[str, str], message: str
) -> None:
    token = world.signer("home").token("peer", *signed)
    resp = await raw(world.peer, *sent, token)
    assert resp.status_code == 401, resp.text
    assert message in resp.json()["message"]


async def test_an_upload_is_checked_against_the_signed_body(world: AuthWorld, tmp_path: Path) -> None:
    """The bundle upload is streamed after authentication: its bytes are hashed as read, and a body
    other than the signed one is refused before anything is stored."""
    (tmp_path / "main.py").write_text("print('hi')\n")
    bundle = pack(tmp_path)
    assert bundle is not None
    path = f"/v1/bundles/{bundle.ref.sha256}"
    other = Token(world.key("home"), iss="home", audience="peer", bsh=hashlib.sha256(b"other").hexdigest())
    async with httpx.AsyncClient(base_url=world.peer.url, timeout=10) as http:
        resp = await http.put(path, content=bundle.data, auth=other)
        assert resp.status_code == 401, resp.text
        assert "another request body" in resp.json()["message"]
        assert (await http.get(path, auth=world.token())).status_code == 404  # nothing stored
        ok = await http.put(path, content=bundle.data, auth=world.token())
        assert ok.status_code == 200, ok.text


async def test_a_token_replayed_after_a_restart_is_refused(world: AuthWorld, tmp_path: Path) -> None:
    """The used-jti memory is in the controller's SQLite state: a kill -9 and restart keep it."""
    ctl = start_controller(
        world.config_path, "peer", tmp_path / "state", port=free_port(), key_dir=world.key_dir
    )
    try:
        token = world.token()
        assert (await raw(ctl, "GET", "/v1/backends", token)).status_code == 200
        ctl.kill9()
        ctl = restart(ctl)
        again = await raw(ctl, "GET", "/v1/backends", token)
        assert again.status_code == 401, again.text
        assert "replayed" in again.json()["message"]
        assert (await raw(ctl, "GET", "/v1/backends", world.token())).status_code == 200
    finally:
        ctl.stop()


async def test_the_jti_store_does_not_block_the_event_loop(world: AuthWorld, tmp_path: Path) -> None:
    """Another writer holds controller.db: a signed request waits for the store, but on a thread;
    the controller keeps answering meanwhile."""
    ctl = start_controller(
        world.config_path, "peer", tmp_path / "state", port=free_port(), key_dir=world.key_dir
    )
    try:
        db = sqlite3.connect(ctl.state_dir / "controller.db", isolation_level=None)
        db.execute("BEGIN IMMEDIATE")  # the write lock the jti insert needs
        try:
            token = world.token().encode(httpx.Request("GET", f"{ctl.url}/v1/backends"))
            headers = {"Authorization": f"Bearer {token}"}
            signed = await HeldRequest(ctl, "/v1/backends", headers).send()
            await poll(signed.in_hands, bool, what="the controller to read the signed request")
            # Health is answered while the signed request still waits: had the wait held the event
            # loop, nothing would answer until the store gave up on the lock and answered it first.
            async with httpx.AsyncClient(base_url=ctl.url, timeout=30) as http:
                assert (await http.get("/v1/health")).status_code == 200
            assert not signed.done()
        finally:
            db.execute("ROLLBACK")
            db.close()
        status, body = await signed.response()
        assert status == 200, body
    finally:
        ctl.stop()


def test_the_jti_store_prunes_expired_ids_by_its_expiry_index(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state")
    try:
        assert store.remember_token("home:old", now_ms() - 1)
        assert store.remember_token("home:new", now_ms() + 60_000)
        assert not store.remember_token("home:new", now_ms() + 60_000)
        with sqlite3.connect(store.path) as db:
            assert db.execute("SELECT jti FROM seen_tokens").fetchall() == [("home:new",)]
            plan = db.execute("EXPLAIN QUERY PLAN DELETE FROM seen_tokens WHERE expires_ms < 1").fetchall()
            assert any("seen_tokens_expiry" in str(row) for row in plan), plan
    finally:
        store.close()


# ---- admission -----------------------------------------------------------------------------------


async def test_local_admin_is_refused(world: AuthWorld) -> None:
    async with world.client("home") as c:
        for user in ("local_admin", "LOCAL_ADMIN"):
            with pytest.raises(PermissionDenied, match="local_admin"):
                await c.launch(request(["true"], user=user))


async def test_requester_must_equal_issuer(world: AuthWorld) -> None:
    async with world.client("home") as c:
        with pytest.raises(PermissionDenied, match="does not match"):
            await c.launch(request(["true"], requester="other"))


async def test_admin_cluster_cannot_hand_in_jobs(world: AuthWorld) -> None:
    async with world.client("ops") as c:
        with pytest.raises(PermissionDenied):
            await c.launch(request(["true"], requester="ops"))


@pytest.mark.parametrize(
    ("user", "allowed"),
    [
        ("alice@example.com", True),
        ("Carol@EXAMPLE.COM", True),  # *@domain is case-insensitive
        ("bob", True),  # exact identity
        ("Bob", False),  # exact means exact
        ("bob@example.org", False),
        ("eve@evil.com", False),
        ("eve@notexample.com", False),
        ("eve@sub.example.com", False),
        ("@example.com", False),
        ("example.com", False),
    ],
)
async def test_allowed_submitters(world: AuthWorld, user: str, allowed: bool) -> None:
    req = request(["true"], user=user)
    async with world.client("home") as c:
        if allowed:
            assert (await c.launch(req)).user == user
        else:
            with pytest.raises(PermissionDenied, match="may not submit"):
                await c.launch(req)


async def test_empty_allowed_submitters_admits_nobody(world: AuthWorld) -> None:
    async with world.client("home", world.closed) as c:
        assert (await c.backends()).cluster == "closed"  # the token itself is fine
        with pytest.raises(PermissionDenied, match="may not submit"):
            await c.launch(request(["true"]))


def test_submitter_patterns() -> None:
    assert submitter_matches(["*"], "anyone")
    assert submitter_matches(["*@a.io"], "x@A.IO")
    assert not submitter_matches(["*@a.io"], "x@b.io")
    assert not submitter_matches([], "anyone")
    assert submitter_matches(["x@a.io"], "x@a.io") and not submitter_matches(["x@a.io"], "X@a.io")


async def test_job_access_only_for_its_requester_or_an_admin(world: AuthWorld) -> None:
    req = request(py("import time; print('hi', flush=True); time.sleep(60)"), job_id="home/secret-job")
    async with world.client("home") as home, world.client("other") as other, world.client("ops") as ops:
        await home.launch(req)
        # Another trusted requester can neither see, read nor stop it, nor take over its id.
        for call in (other.status(req.job_id), other.logs(req.job_id), other.terminate(req.job_id)):
            with pytest.raises(PermissionDenied):
                await call
        assert req.job_id not in [j.job_id for j in await other.list_jobs()]
        # Nor learn of it from the change feed (its changes, or its removal).
        listing = await other.jobs_page()
        assert req.job_id not in [j.job_id for j in listing.jobs]
        assert listing.cursor is not None
        seen = await other.changes(listing.cursor.rsplit("-", 1)[0] + "-0")
        assert not seen.resync and req.job_id not in [j.job_id for j in seen.jobs]
        with pytest.raises(AlreadyExists):
            await other.launch(req.model_copy(update={"requester": "other"}))
        # The owner and an admin can.
        assert (await home.status(req.job_id)).state in (S.PENDING, S.RUNNING)
        assert req.job_id in [j.job_id for j in await ops.list_jobs()]
        await ops.logs(req.job_id)
        assert (await ops.terminate(req.job_id)).state is S.KILLED
        assert (await wait_terminal(home, req.job_id)).state is S.KILLED
