"""Identity and admission (docs/DESIGN.md, "Handoff and admission"; issue 4 item 4) against real
controller processes.

Each refusal has a test that passes only while its check is in place.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
from controller_harness import (
    Controller,
    cluster,
    federation,
    gpu_backend,
    key_auth,
    make_keys,
    py,
    request,
    signer_for,
    start_controller,
    wait_terminal,
    write_config,
)
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from iris.config import load_config
from iris.controller.client import ControllerClient
from iris.controller.errors import AlreadyExists, PermissionDenied, Unauthenticated
from iris.controller.identity import TokenSigner, load_private_key, submitter_matches
from iris.controller.models import ControllerJobState as S


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


def claims(iss: str = "home", **overrides: Any) -> dict[str, Any]:
    now = int(time.time())
    base = {"iss": iss, "sub": iss, "aud": "federation", "iat": now, "exp": now + 60, "jti": uuid.uuid4().hex}
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


async def raw(ctl: Controller, method: str, path: str, token: str | None, body: Any = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with httpx.AsyncClient(base_url=ctl.url, timeout=10) as http:
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
    resp = await raw(
        world.peer, "GET", "/v1/backends", jwt.encode(claims(), world.key("home"), algorithm="EdDSA")
    )
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize(
    ("case", "signer", "overrides"),
    [
        ("forged: claims home, signed by stranger's key", "stranger", {}),
        ("untrusted issuer with its own key", "stranger", {"iss": "stranger", "sub": "stranger"}),
        ("unknown issuer", "home", {"iss": "nobody", "sub": "nobody"}),
        ("wrong audience", "home", {"aud": "someone-else"}),
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
    token = jwt.encode(claims(**overrides), world.key(signer), algorithm="EdDSA")
    resp = await raw(world.peer, "POST", "/v1/jobs", token, launch_body())
    assert resp.status_code == 401, f"{case}: {resp.text}"
    assert resp.json()["code"] == "UNAUTHENTICATED"


async def test_token_signed_with_another_algorithm_is_refused(world: AuthWorld) -> None:
    # HS256 keyed with the (public) key text: the classic algorithm-confusion forgery.
    # PyJWT refuses to mint it, so it is assembled by hand.
    pub = (world.key_dir / "home.pub").read_bytes()

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    signing_input = (
        b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode()) + "." + b64(json.dumps(claims()).encode())
    )
    token = signing_input + "." + b64(hmac.new(pub, signing_input.encode(), hashlib.sha256).digest())
    for alg_none in (signing_input + ".", b64(b'{"alg":"none"}') + "." + signing_input.split(".")[1] + "."):
        assert (await raw(world.peer, "GET", "/v1/backends", alg_none)).status_code == 401
    resp = await raw(world.peer, "GET", "/v1/backends", token)
    assert resp.status_code == 401


async def test_replayed_token_is_refused(world: AuthWorld) -> None:
    token = jwt.encode(claims(), world.key("home"), algorithm="EdDSA")
    assert (await raw(world.peer, "GET", "/v1/backends", token)).status_code == 200
    again = await raw(world.peer, "GET", "/v1/backends", token)
    assert again.status_code == 401 and "replayed" in again.json()["message"]


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
        with pytest.raises(AlreadyExists):
            await other.launch(req.model_copy(update={"requester": "other"}))
        # The owner and an admin can.
        assert (await home.status(req.job_id)).state in (S.PENDING, S.RUNNING)
        assert req.job_id in [j.job_id for j in await ops.list_jobs()]
        await ops.logs(req.job_id)
        assert (await ops.terminate(req.job_id)).state is S.KILLED
        assert (await wait_terminal(home, req.job_id)).state is S.KILLED
