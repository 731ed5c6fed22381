"""Identity and admission (docs/DESIGN.md, "Handoff and admission",
"6. No credential crosses clusters; no unauthenticated or disallowed handoff is admitted") against
the running stack's real controllers.

Tokens are signed with the stack's real keys (or deliberately wrong ones) and sent to the
controllers' configured addresses, exactly where the worker sends its handoffs. Every refusal is
checked for its code and for having left no job behind; the ones a workflow can meet are also
driven end to end, through a worker, to the job state a user sees.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from security_support import RESTRICTED_DOMAIN, Keys, Responses, Restricted
from signing import Token
from stack import Stack, wait_until

from iris import devstack
from iris.client import AsyncIrisClient
from iris.config import FederationConfig
from iris.contract import manager_workflow_id
from iris.controller.client import ControllerClient
from iris.controller.identity import TokenSigner
from iris.controller.models import LaunchRequest
from iris.jobs import JobSpec, JobState
from iris.store import FederationStore
from worker.main import build_worker, ensure_manager

CLUSTERS = ["marin", "cw-us-east-02a", "cw-rno2a"]
HOME = "marin"


def sign(key: Ed25519PrivateKey | None, *, algorithm: str = "EdDSA", **overrides: Any) -> Token:
    """Claims of marin signed with ``key``; unless overridden, ``aud`` names the controller the
    token is sent to, and ``htm``/``htp``/``bsh`` the request it is sent with (tests/signing.py)."""
    iss = overrides.pop("iss", HOME)
    return Token(key, iss=iss, audience=None, algorithm=algorithm, **overrides)


def launch(
    job_id: str, *, user: str = "tester@example.com", requester: str = HOME, **extra: Any
) -> dict[str, Any]:
    body = LaunchRequest(
        job_id=job_id,
        command=["true"],
        user=user,
        requester=requester,
        nonce=f"{job_id}@1",
        backend_id="any",
    ).model_dump(mode="json")
    return {**body, **extra}


def backend_of(stack: Stack, cluster: str) -> str:
    return stack.config.cluster(cluster).backends[0].id


@dataclass
class Api:
    stack: Stack
    keys: Keys
    responses: Responses
    audiences: dict[str, str] = field(default_factory=dict)

    def home_key(self) -> Ed25519PrivateKey:
        return self.keys.private(self.stack.config, HOME)

    async def audience(self, url: str) -> str:
        """The cluster id of the controller at ``url`` (it says so on /v1/health)."""
        if url not in self.audiences:
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                self.audiences[url] = (await http.get("/v1/health")).json()["cluster"]
        return self.audiences[url]

    async def call(
        self, url: str, method: str, path: str, token: str | Token | None, body: Any = None
    ) -> httpx.Response:
        """One request; a ``str`` token is sent as is (a captured one), a ``Token`` is signed for
        this request at this controller."""
        headers = {"Authorization": f"Bearer {token}"} if isinstance(token, str) else {}
        auth = token.addressed(await self.audience(url)) if isinstance(token, Token) else None
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            if auth is not None:
                resp = await http.request(method, path, json=body, auth=auth)
            else:
                resp = await http.request(method, path, headers=headers, json=body)
        self.responses.add(resp.text)
        return resp

    async def knows(self, url: str, job_id: str) -> bool:
        """Whether the controller at ``url`` holds ``job_id`` (asked with a valid home token)."""
        resp = await self.call(url, "GET", f"/v1/jobs/{job_id}", sign(self.home_key()))
        assert resp.status_code in (200, 404), resp.text
        return resp.status_code == 200


@pytest.fixture
def api(stack: Stack, keys: Keys, responses: Responses) -> Api:
    return Api(stack, keys, responses)


def refused(resp: httpx.Response, status: int, code: str, message: str) -> None:
    assert resp.status_code == status, f"{resp.status_code}: {resp.text}"
    body = resp.json()
    assert body["code"] == code, body
    assert message in body["message"], body


# ---- authentication: every controller of the stack ---------------------------------------------

FRESH = Ed25519PrivateKey.generate()


def _forged(api: Api) -> Token:
    return sign(FRESH)  # claims to be marin, signed by a key nobody pinned


def _unknown_issuer(api: Api) -> Token:
    return sign(FRESH, iss="mallory", sub="mallory")


def _untrusted_member(api: Api) -> Token:
    # A real federation member's real key: peers trust only the home cluster to hand jobs in.
    return sign(
        api.keys.private(api.stack.config, "cw-us-east-02a"), iss="cw-us-east-02a", sub="cw-us-east-02a"
    )


def _expired(api: Api) -> Token:
    now = int(time.time())
    return sign(api.home_key(), iat=now - 200, nbf=now - 200, exp=now - 100)


def _wrong_audience(api: Api) -> Token:
    return sign(api.home_key(), aud="payments")


def _not_yet_valid(api: Api) -> Token:
    now = int(time.time())
    return sign(api.home_key(), iat=now, nbf=now + 120, exp=now + 180)


def _too_long_lived(api: Api) -> Token:
    now = int(time.time())
    return sign(api.home_key(), iat=now, exp=now + 3600)


def _subject_mismatch(api: Api) -> Token:
    return sign(api.home_key(), sub="cw-rno2a")


def _alg_none(api: Api) -> Token:
    return sign(None, algorithm="none")


def _old_shared_audience(api: Api) -> Token:
    return sign(api.home_key(), aud="federation")  # what every token carried before issue 16


def _another_method(api: Api) -> Token:
    return sign(api.home_key(), htm="DELETE")


def _another_path(api: Api) -> Token:
    return sign(api.home_key(), htp="/v1/health")


def _another_body(api: Api) -> Token:
    return sign(api.home_key(), bsh=hashlib.sha256(b"{}").hexdigest())


def _unbound(api: Api) -> Token:
    return sign(api.home_key(), htm=None, htp=None, bsh=None)


TOKEN_CASES = {
    "forged-signature": (_forged, "identity token rejected"),
    "unknown-key": (_unknown_issuer, "is not a trusted cluster"),
    "untrusted-member": (_untrusted_member, "is not a trusted cluster"),
    "expired": (_expired, "identity token expired"),
    "wrong-audience": (_wrong_audience, "InvalidAudienceError"),
    "old-shared-audience": (_old_shared_audience, "not addressed to cluster"),
    "signed-for-another-method": (_another_method, "signed for another method"),
    "signed-for-another-path": (_another_path, "signed for another path"),
    "signed-for-another-body": (_another_body, "signed for another request body"),
    "not-bound-to-a-request": (_unbound, "MissingRequiredClaimError"),
    "not-yet-valid": (_not_yet_valid, "ImmatureSignatureError"),
    "lifetime-over-5-minutes": (_too_long_lived, "lifetime exceeds"),
    "subject-is-not-issuer": (_subject_mismatch, "subject must equal its issuer"),
    "alg-none": (_alg_none, "must be signed with EdDSA"),
}


@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize("case", sorted(TOKEN_CASES))
async def test_a_bad_identity_token_is_unauthenticated_and_admits_nothing(
    stack: Stack, api: Api, cluster: str, case: str
) -> None:
    make, message = TOKEN_CASES[case]
    url = stack.config.cluster(cluster).url
    job_id = f"security/{case}-{uuid.uuid4().hex[:6]}"
    resp = await api.call(url, "POST", "/v1/jobs", make(api), launch(job_id))
    refused(resp, 401, "UNAUTHENTICATED", message)
    for path in ("/v1/backends", "/v1/jobs"):
        refused(await api.call(url, "GET", path, make(api)), 401, "UNAUTHENTICATED", "")
    assert not await api.knows(url, job_id)


@pytest.mark.parametrize("cluster", CLUSTERS)
async def test_no_token_is_unauthenticated(stack: Stack, api: Api, cluster: str) -> None:
    url = stack.config.cluster(cluster).url
    refused(
        await api.call(url, "POST", "/v1/jobs", None, launch("security/anon")), 401, "UNAUTHENTICATED", ""
    )
    refused(
        await api.call(url, "GET", "/v1/backends", None), 401, "UNAUTHENTICATED", "missing identity token"
    )


async def test_a_replayed_handoff_token_is_refused_and_runs_nothing_twice(stack: Stack, api: Api) -> None:
    url = stack.config.cluster("cw-us-east-02a").url
    job_id = f"security/replayed-{uuid.uuid4().hex[:6]}"
    token = sign(api.home_key())
    body = launch(job_id, backend_id=backend_of(stack, "cw-us-east-02a"))
    first = await api.call(url, "POST", "/v1/jobs", token, body)
    assert first.status_code == 200, first.text
    again = await api.call(url, "POST", "/v1/jobs", token, body)  # the captured request, verbatim
    refused(again, 401, "UNAUTHENTICATED", "replayed (jti already used)")
    status = await api.call(url, "GET", f"/v1/jobs/{job_id}", sign(api.home_key()))
    assert status.json()["attempts"] == 1
    # Also on a read: the same jti twice is refused whatever the route.
    read = sign(api.home_key())
    assert (await api.call(url, "GET", "/v1/backends", read)).status_code == 200
    refused(await api.call(url, "GET", "/v1/backends", read), 401, "UNAUTHENTICATED", "replayed")


class Recording(httpx.AsyncHTTPTransport):
    """The wire as an eavesdropper on the home worker's link sees it: every request sent."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[httpx.Request] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request)
        return await super().handle_async_request(request)


async def replay(url: str, captured: httpx.Request, api: Api) -> httpx.Response:
    """``captured`` sent again, verbatim (method, path and query, token, body), to ``url``."""
    headers = {k: v for k, v in captured.headers.items() if k.lower() in ("authorization", "content-type")}
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        resp = await http.request(
            captured.method, captured.url.raw_path.decode(), headers=headers, content=captured.content
        )
    api.responses.add(resp.text)
    return resp


async def test_a_token_captured_at_one_peer_is_refused_at_another(stack: Stack, api: Api) -> None:
    """Issue 16, acceptance 2: a handoff and a read home's client really sent to cw-us-east-02a,
    replayed verbatim at cw-rno2a (which trusts the same home key), are refused there."""
    src, dst = "cw-us-east-02a", "cw-rno2a"
    wire = Recording()
    job_id = f"security/captured-{uuid.uuid4().hex[:6]}"
    req = LaunchRequest.model_validate(launch(job_id, backend_id=backend_of(stack, src)))
    signer = TokenSigner(HOME, api.home_key())
    async with ControllerClient(
        stack.config.cluster(src).url, signer=signer, audience=src, transport=wire
    ) as c:
        assert (await c.launch(req)).job_id == job_id
        await c.backends()
    handoff, read = wire.sent
    for captured in (handoff, read):
        refused(
            await replay(stack.config.cluster(dst).url, captured, api),
            401,
            "UNAUTHENTICATED",
            f"not addressed to cluster {dst}",
        )
    assert not await api.knows(stack.config.cluster(dst).url, job_id)


async def test_a_token_replayed_after_a_controller_restart_is_refused(stack: Stack, api: Api) -> None:
    """The used-jti memory survives a crash: a real cw-rno2a controller on its own state, killed
    (SIGKILL) and started again, refuses the request it accepted before."""
    root = stack.data_dir / f"security-restart-{uuid.uuid4().hex[:6]}"
    root.mkdir()
    cfg = stack.config.model_copy(deep=True)
    cfg.cluster("cw-rno2a").port = devstack.free_port()
    config_file = root / "clusters.json"
    config_file.write_text(cfg.model_dump_json(indent=2))
    proc = devstack.controller(config_file, cfg, "cw-rno2a", root)
    url = cfg.cluster("cw-rno2a").url
    proc.start()
    try:
        await asyncio.to_thread(proc.wait_ready, 60)
        job_id = f"security/restart-{uuid.uuid4().hex[:6]}"
        token = sign(api.home_key())
        body = launch(job_id, backend_id=backend_of(stack, "cw-rno2a"))
        assert (await api.call(url, "POST", "/v1/jobs", token, body)).status_code == 200
        await asyncio.to_thread(proc.kill)
        proc.start()
        await asyncio.to_thread(proc.wait_ready, 60)
        refused(await api.call(url, "POST", "/v1/jobs", token, body), 401, "UNAUTHENTICATED", "replayed")
        status = await api.call(url, "GET", f"/v1/jobs/{job_id}", sign(api.home_key()))
        assert status.json()["attempts"] == 1, status.text
    finally:
        await asyncio.to_thread(proc.stop)


# ---- admission ------------------------------------------------------------------------------------


@pytest.mark.parametrize("cluster", CLUSTERS)
async def test_requester_must_equal_the_token_issuer(stack: Stack, api: Api, cluster: str) -> None:
    url = stack.config.cluster(cluster).url
    job_id = f"security/mismatch-{uuid.uuid4().hex[:6]}"
    resp = await api.call(url, "POST", "/v1/jobs", sign(api.home_key()), launch(job_id, requester="cw-rno2a"))
    refused(resp, 403, "PERMISSION_DENIED", "does not match the signed identity 'marin'")
    assert not await api.knows(url, job_id)


@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize("user", ["local_admin", "LOCAL_ADMIN", " local_admin "])
async def test_local_admin_is_refused(stack: Stack, api: Api, cluster: str, user: str) -> None:
    url = stack.config.cluster(cluster).url
    job_id = f"security/local-admin-{uuid.uuid4().hex[:6]}"
    resp = await api.call(url, "POST", "/v1/jobs", sign(api.home_key()), launch(job_id, user=user))
    refused(resp, 403, "PERMISSION_DENIED", "local_admin")
    assert not await api.knows(url, job_id)


@pytest.mark.parametrize(
    ("user", "allowed"),
    [
        (f"alice@{RESTRICTED_DOMAIN}", True),
        (f"Bob@{RESTRICTED_DOMAIN.upper()}", True),
        ("eve@evil.example", False),
        (f"eve@{RESTRICTED_DOMAIN}.evil.example", False),
        (f"eve@sub.{RESTRICTED_DOMAIN}", False),
        (RESTRICTED_DOMAIN, False),
        ("tester@example.com", False),
    ],
)
async def test_only_allowed_submitters_are_admitted(
    stack: Stack, api: Api, restricted: Restricted, user: str, allowed: bool
) -> None:
    job_id = f"security/submitter-{uuid.uuid4().hex[:6]}"
    body = launch(job_id, user=user, backend_id=backend_of(stack, "cw-rno2a"))
    resp = await api.call(restricted.url, "POST", "/v1/jobs", sign(api.home_key()), body)
    if allowed:
        assert resp.status_code == 200, resp.text
        assert resp.json()["user"] == user
    else:
        refused(resp, 403, "PERMISSION_DENIED", f"user {user!r} may not submit to cluster cw-rno2a")
        assert not await api.knows(restricted.url, job_id)


async def test_a_job_claiming_a_parent_is_refused(stack: Stack, api: Api) -> None:
    """Only root jobs federate (docs/DESIGN.md, "Classification"). Nothing in this code base creates
    child jobs: JobSpec and the handoff request have no parent field, and a handoff that claims one
    is refused as invalid."""
    assert not any("parent" in name for name in JobSpec.model_fields)
    assert not any("parent" in name for name in LaunchRequest.model_fields)
    url = stack.config.cluster("cw-us-east-02a").url
    for field_name in ("parent_job_id", "parent", "root_job_id"):
        job_id = f"security/child-{uuid.uuid4().hex[:6]}"
        body = launch(job_id, **{field_name: "tester/parent"})
        resp = await api.call(url, "POST", "/v1/jobs", sign(api.home_key()), body)
        refused(resp, 400, "INVALID_ARGUMENT", field_name)
        assert not await api.knows(url, job_id)


# ---- end to end: what a user sees when a peer refuses ------------------------------------------


async def test_a_local_admin_job_ends_handoff_rejected_and_never_runs(stack: Stack, api: Api) -> None:
    job_id = await stack.iris.submit(
        ["true"],
        name=f"sec-local-admin-{uuid.uuid4().hex[:6]}",
        user="local_admin",
        target_cluster="cw-us-east-02a",
    )
    final = await stack.iris.wait(job_id, timeout_s=60)
    assert final.state is JobState.HANDOFF_REJECTED, final.reason
    assert "cw-us-east-02a refused the job" in final.reason and "local_admin" in final.reason
    assert not await api.knows(stack.config.cluster("cw-us-east-02a").url, job_id)


@dataclass
class OwnWorker:
    iris: AsyncIrisClient
    config: FederationConfig
    store: FederationStore


async def own_worker(stack: Stack, cfg: FederationConfig, root: Path) -> AsyncIterator[OwnWorker]:
    """An in-process worker on its own task queue and store, for a variant of the federation config."""
    cfg.temporal.task_queue = f"iris-security-{uuid.uuid4().hex[:8]}"
    store = FederationStore(f"sqlite:///{root / 'federation.db'}")
    worker = build_worker(stack.client, cfg, store)
    try:
        async with worker:
            await ensure_manager(stack.client, cfg)
            yield OwnWorker(AsyncIrisClient(stack.client, cfg), cfg, store)
            await stack.client.get_workflow_handle(manager_workflow_id(cfg.temporal.task_queue)).terminate()
    finally:
        store.close()


@pytest.fixture
async def restricted_federation(
    stack: Stack, restricted: Restricted, tmp_path: Path
) -> AsyncIterator[OwnWorker]:
    async for w in own_worker(stack, restricted.config.model_copy(deep=True), tmp_path):
        yield w


async def test_a_disallowed_submitter_ends_handoff_rejected_with_the_peers_reason(
    restricted_federation: OwnWorker, api: Api, restricted: Restricted
) -> None:
    iris = restricted_federation.iris
    job_id = await iris.submit(
        ["true"], name=f"sec-eve-{uuid.uuid4().hex[:6]}", user="eve@evil.example", target_cluster="cw-rno2a"
    )
    final = await iris.wait(job_id, timeout_s=60)
    assert final.state is JobState.HANDOFF_REJECTED, final.reason
    assert "may not submit to cluster cw-rno2a" in final.reason
    assert not await api.knows(restricted.url, job_id)
    ok = await iris.submit(
        ["true"],
        name=f"sec-alice-{uuid.uuid4().hex[:6]}",
        user=f"alice@{RESTRICTED_DOMAIN}",
        target_cluster="cw-rno2a",
    )
    assert (await iris.wait(ok, timeout_s=60)).state is JobState.SUCCEEDED


@pytest.fixture
async def forged_federation(stack: Stack, tmp_path: Path) -> AsyncIterator[OwnWorker]:
    """The home cluster's worker signing with a key no peer pinned (a stolen config, a rotated key)."""
    forged = tmp_path / "forged-marin.key"
    forged.write_bytes(
        Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    cfg = stack.config.model_copy(deep=True)
    auth = cfg.cluster(HOME).auth
    assert auth is not None
    auth.private_key_file = str(forged)
    async for w in own_worker(stack, cfg, tmp_path):
        yield w


async def test_a_worker_with_a_forged_key_gets_nothing_admitted(
    forged_federation: OwnWorker, stack: Stack, api: Api
) -> None:
    iris = forged_federation.iris
    job_id = await iris.submit(
        ["true"], name=f"sec-forged-{uuid.uuid4().hex[:6]}", target_cluster="cw-us-east-02a"
    )

    async def refused_identity() -> bool:
        st = await iris.describe(job_id)
        reports = await asyncio.to_thread(forged_federation.store.load_reports)
        peer = next((r for r in reports if r.peer_id == "cw-us-east-02a"), None)
        return (
            st.state is JobState.QUEUED_HANDOFF
            and "cw-us-east-02a unreachable" in st.reason
            and peer is not None
            and "UNAUTHENTICATED" in (peer.error or "")
        )

    await wait_until(refused_identity, timeout=60, what="the job to wait while the peer refuses our identity")
    for cluster in CLUSTERS:
        assert not await api.knows(stack.config.cluster(cluster).url, job_id)
    outcome = await iris.cancel_and_report(job_id)
    assert outcome.won
    assert (await iris.wait(job_id, timeout_s=30)).state is JobState.KILLED
