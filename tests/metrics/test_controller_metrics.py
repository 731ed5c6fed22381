"""A controller's ``GET /metrics`` (docs/DESIGN.md, "Metrics"): requests by route template, launches by
backend and outcome, refusals by reason, running jobs and free devices by backend; open without a
token, and naming no job, user, requester or secret. The controller app runs in this process under
uvicorn with auth on; its requests are signed as a peer's would be, and a real job runs."""

from __future__ import annotations

import contextlib
import os
import pwd
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from exposition import exposition
from served import served
from stack import wait_until

from iris import devstack, metrics
from iris.config import FederationConfig
from iris.controller.app import create_app
from iris.controller.client import ControllerClient
from iris.controller.errors import AlreadyExists, InvalidArgument, PermissionDenied
from iris.controller.identity import generate_keypair
from iris.controller.models import LaunchRequest
from iris.policy.models import Band, DeviceRequest

HOME, PEER, AUDITOR = "hq", "gpu-east", "auditor"
SECRET = "job-env-secret-9f3c1e"
USER = "alice@example.com"


def labels(**kw: str) -> frozenset[tuple[str, str]]:
    return frozenset(kw.items())


@dataclass
class Peer:
    config: FederationConfig
    key_dir: Path
    url: str
    # The app's route templates (the only values of the route label but ``unmatched``).
    routes: set[str]

    def client(self, as_cluster: str = HOME) -> ControllerClient:
        return ControllerClient.for_cluster(self.config, PEER, as_cluster=as_cluster, key_dir=self.key_dir)

    async def scrape(self) -> tuple[httpx.Response, dict[tuple[str, frozenset[tuple[str, str]]], float]]:
        async with httpx.AsyncClient(base_url=self.url, timeout=10) as http:
            resp = await http.get("/metrics")  # no token
        return resp, exposition(resp.text)


def _config() -> FederationConfig:
    def auth(name: str, **extra: object) -> dict[str, object]:
        return {"private_key_file": f"{name}.key", "public_key_file": f"{name}.pub", **extra}

    return FederationConfig.model_validate(
        {
            "home": HOME,
            "clusters": [
                {"name": HOME, "port": devstack.free_port(), "auth": auth(HOME), "backends": []},
                {"name": AUDITOR, "port": devstack.free_port(), "auth": auth(AUDITOR), "backends": []},
                {
                    "name": PEER,
                    "port": devstack.free_port(),
                    "run_as": pwd.getpwuid(os.geteuid()).pw_name,
                    "auth": auth(
                        PEER,
                        trusted_requesters=[HOME],
                        admins=[AUDITOR],
                        allowed_submitters=["*@example.com"],
                    ),
                    "backends": [
                        {
                            "id": "h100-east",
                            "attributes": {"device-type": ["gpu"], "device-variant": ["h100"]},
                            "devices": {"h100": 16},
                            "cpu_slots": 4,
                        },
                        {"id": "cpu-east", "attributes": {"device-type": ["cpu"]}, "cpu_slots": 2},
                    ],
                },
            ],
        }
    )


@pytest.fixture
async def peer(tmp_path: Path) -> AsyncIterator[Peer]:
    config = _config()
    key_dir = tmp_path / "keys"
    key_dir.mkdir()
    for name in (HOME, AUDITOR, PEER):
        generate_keypair(key_dir, name)
    port = config.cluster(PEER).port
    app = create_app(config, PEER, tmp_path / "state", key_dir=key_dir, kill_grace_s=0.5)
    async with served(app, port):
        routes = {str(getattr(r, "path", "")) for r in app.router.routes}
        yield Peer(config, key_dir, f"http://127.0.0.1:{port}", routes)


def launch(job_id: str, **kw: object) -> LaunchRequest:
    fields: dict[str, object] = {
        "job_id": job_id,
        "command": [sys.executable, "-c", "import time; time.sleep(60)"],
        "env": {"TOKEN": SECRET},
        "device": DeviceRequest(type="gpu", variant="h100", count=8),
        "band": Band.INTERACTIVE,
        "user": USER,
        "requester": HOME,
        "nonce": "n-1",
        "backend_id": "h100-east",
    }
    fields.update(kw)
    return LaunchRequest.model_validate(fields)


async def test_metrics_count_by_bounded_labels_and_name_no_job_user_or_secret(peer: Peer) -> None:
    resp, before = await peer.scrape()
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    # Every known series exists from the start, at 0.
    for reason in metrics.REFUSAL_REASONS:
        assert before[(metrics.CONTROLLER_REFUSALS, labels(reason=reason))] == 0
    assert before[(metrics.CONTROLLER_LAUNCHES, labels(backend="cpu-east", outcome="accepted"))] == 0

    job = "secret-project/train-7b"
    async with peer.client() as c:
        await c.launch(launch(job))
        await c.launch(launch(job))  # the same nonce: replayed
        with pytest.raises(AlreadyExists):
            await c.launch(launch(job, nonce="n-2"))
        with pytest.raises(PermissionDenied):
            await c.launch(launch("secret-project/eve", user="eve@evil.example"))
        with pytest.raises(PermissionDenied):
            await c.launch(launch("secret-project/admin", user="local_admin"))
        with pytest.raises(PermissionDenied):
            await c.launch(launch("secret-project/other", requester="someone-else"))
        with pytest.raises(InvalidArgument):
            await c.launch(launch("secret-project/huge", device=DeviceRequest(type="gpu", count=64)))
        with pytest.raises(InvalidArgument):
            await c.launch(launch("secret-project/nowhere", backend_id="backend-of-nobody"))
        for n in range(3):
            await c.status(job)
            with contextlib.suppress(Exception):
                await c.status(f"secret-project/absent-{n}")
    async with peer.client(as_cluster=AUDITOR) as c:
        with pytest.raises(PermissionDenied):
            await c.launch(launch("secret-project/audit", requester=AUDITOR))
    async with httpx.AsyncClient(base_url=peer.url, timeout=10) as http:
        assert (await http.get("/v1/backends")).status_code == 401
        assert (await http.get("/no/such/path/secret-project")).status_code == 404

    seen: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}

    async def running() -> bool:
        nonlocal seen
        _, seen = await peer.scrape()
        return seen.get((metrics.CONTROLLER_RUNNING_JOBS, labels(backend="h100-east"))) == 1

    await wait_until(running, timeout=20, what="one job running on h100-east")
    resp, _ = await peer.scrape()
    requests = {k[1]: v for k, v in seen.items() if k[0] == metrics.CONTROLLER_REQUESTS}
    assert requests[labels(method="POST", route="/v1/jobs", status="200")] == 2
    assert requests[labels(method="POST", route="/v1/jobs", status="403")] == 4
    assert requests[labels(method="POST", route="/v1/jobs", status="409")] == 1
    assert requests[labels(method="POST", route="/v1/jobs", status="400")] == 2
    # Six job ids, one series per status: the route's template, never the path.
    assert requests[labels(method="GET", route="/v1/jobs/{job_id:path}", status="200")] == 3
    assert requests[labels(method="GET", route="/v1/jobs/{job_id:path}", status="404")] == 3
    assert requests[labels(method="GET", route="/v1/backends", status="401")] == 1
    assert requests[labels(method="GET", route="unmatched", status="404")] == 1
    assert {dict(k)["route"] for k in requests} <= peer.routes | {"unmatched"}

    def launches(backend: str, outcome: str) -> float:
        return seen[(metrics.CONTROLLER_LAUNCHES, labels(backend=backend, outcome=outcome))]

    assert launches("h100-east", "accepted") == 1
    assert launches("h100-east", "replayed") == 1
    assert launches("h100-east", "refused") == 6
    assert launches("unknown", "refused") == 1  # an unconfigured backend id is not a label value

    def refusals(reason: str) -> float:
        return seen[(metrics.CONTROLLER_REFUSALS, labels(reason=reason))]

    assert {r: refusals(r) for r in metrics.REFUSAL_REASONS} == {
        "unauthenticated": 1,
        "local_admin": 1,
        "requester_mismatch": 1,
        "requester_not_trusted": 1,
        "submitter_not_allowed": 1,
        "already_exists": 1,
        "unsupported_demand": 2,
    }
    assert seen[(metrics.CONTROLLER_RUNNING_JOBS, labels(backend="cpu-east"))] == 0
    assert seen[(metrics.CONTROLLER_FREE_SLOTS, labels(backend="h100-east", device="h100"))] == 8
    assert seen[(metrics.CONTROLLER_FREE_SLOTS, labels(backend="cpu-east", device="cpu"))] == 2

    # Exactly the names iris/metrics.py gives (no _created twin of a counter, nothing else).
    assert {name for name, _ in seen} == {
        metrics.CONTROLLER_REQUESTS,
        metrics.CONTROLLER_LAUNCHES,
        metrics.CONTROLLER_REFUSALS,
        metrics.CONTROLLER_RUNNING_JOBS,
        metrics.CONTROLLER_FREE_SLOTS,
    }

    # Nothing that names a job, a user, a requester or a secret.
    # (``local_admin`` is a refusal reason's name: the refused user is the same word, by design.)
    for word in ("secret-project", "train-7b", USER, "alice", "eve@", "evil.example", HOME, AUDITOR,
                 "someone-else", "backend-of-nobody", SECRET, "n-1", "n-2"):  # fmt: skip
        assert word not in resp.text, word
    for path in peer.key_dir.iterdir():
        assert path.read_text().strip() not in resp.text
    async with peer.client() as c:
        await c.terminate(job)
