"""Credentials never cross clusters (docs/DESIGN.md, "Credentials"): each cluster's object-store
credentials are held by that cluster's processes alone, and the artifact check of a handoff runs on
the destination's controller, with the destination's credentials.

On the session stack: this pytest process hosts the home cluster's worker, so it must hold no
peer's credentials, while a job whose artifact is in a peer's store still passes (or fails) its
check there; each controller's environment (``/proc/<pid>/environ``) holds its own credentials and
no other cluster's; and ``POST /v1/artifacts/check`` admits only verified callers and well-formed
bodies, and answers from the asked controller's own store.
"""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
from security_support import Responses
from signing import SignerAuth
from stack import Stack, wait_until

from iris import devstack
from iris.controller.client import ControllerClient
from iris.controller.identity import TokenSigner
from iris.jobs import JobState

CLUSTERS = ["marin", "cw-us-east-02a", "cw-rno2a"]
HOME = "marin"


def peer_credentials(stack: Stack) -> dict[str, str]:
    """Every credential variable of every cluster but the home one, with its demo value."""
    return {
        name: value
        for cluster, creds in devstack.all_store_credentials(stack.config).items()
        if cluster != stack.config.home
        for name, value in creds.items()
    }


def assert_this_process_holds_no_peer_credentials(stack: Stack) -> None:
    creds = peer_credentials(stack)
    assert len(creds) == 4, creds.keys()  # two S3 peers, a key and a secret each
    assert sorted(set(creds) & set(os.environ)) == []
    held = [name for name, value in creds.items() if any(value in v for v in os.environ.values())]
    assert held == [], f"this process holds the values of {held}"


def controller_environ(stack: Stack, cluster: str) -> bytes:
    proc = stack.services[f"controller {cluster}"].proc
    assert proc is not None and proc.poll() is None, f"controller {cluster} is not running"
    with open(f"/proc/{proc.pid}/environ", "rb") as f:
        return f.read()


def parse_environ(raw: bytes) -> dict[str, str]:
    pairs = (entry.decode("utf-8", "surrogateescape").partition("=") for entry in raw.split(b"\0") if entry)
    return {name: value for name, _, value in pairs}


def home_auth(stack: Stack, cluster: str) -> SignerAuth:
    """Tokens of the home cluster for requests to ``cluster`` (bound to each request)."""
    return SignerAuth(TokenSigner.from_config(stack.config, HOME, stack.key_dir), cluster)


def test_the_home_process_holds_no_peer_credentials(stack: Stack) -> None:
    assert_this_process_holds_no_peer_credentials(stack)


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_a_controller_holds_its_own_credentials_and_no_other_clusters(stack: Stack, cluster: str) -> None:
    raw = controller_environ(stack, cluster)
    environ = parse_environ(raw)
    assert "IRIS_JOB_ID" not in environ and environ.get("PATH"), "not a controller's environment"
    everyone = devstack.all_store_credentials(stack.config)
    own = everyone[cluster]
    assert {name: environ.get(name) for name in own} == own
    for other, creds in everyone.items():
        if other == cluster:
            continue
        for name, value in creds.items():
            assert name not in environ, f"controller {cluster} holds {other}'s {name}"
            assert value.encode() not in raw, f"controller {cluster} holds {other}'s {name} value"


async def test_a_peer_artifact_is_checked_by_the_peer_with_its_own_credentials(stack: Stack) -> None:
    assert_this_process_holds_no_peer_credentials(stack)
    log = stack.services["controller cw-rno2a"].log_path
    checks_before = log.read_text().count("POST /v1/artifacts/check -> 200")
    await asyncio.to_thread(stack.put_artifact, "cw-rno2a-artifacts", "creds/shard-0")
    present = "s3://cw-rno2a-artifacts/creds/shard-0"
    ok = await stack.iris.submit(
        ["true"], name="creds-present", target_cluster="cw-rno2a", artifacts=[present]
    )
    final = await stack.iris.wait(ok, timeout_s=90)
    assert final.state is JobState.SUCCEEDED, final.reason
    assert final.cluster == "cw-rno2a"
    assert any("Checking 1 artifact(s) in cw-rno2a's object store" in e.message for e in final.events)

    absent = "s3://cw-rno2a-artifacts/creds/absent.bin"
    parked = await stack.iris.submit(
        ["true"], name="creds-absent", target_cluster="cw-rno2a", artifacts=[absent]
    )

    async def failed() -> bool:
        return (await stack.iris.describe(parked)).state is JobState.HANDOFF_FAILED

    await wait_until(failed, timeout=60, what=f"{parked} HANDOFF_FAILED")
    assert (
        await stack.iris.describe(parked)
    ).reason == f"Artifact {absent} missing in cw-rno2a's object store"
    await stack.iris.cancel(parked)
    assert (await stack.iris.wait(parked, timeout_s=30)).state is JobState.KILLED
    # Both checks were answered by cw-rno2a's controller, asked by the home cluster.
    lines = [line for line in log.read_text().splitlines() if "POST /v1/artifacts/check -> 200" in line]
    assert len(lines) - checks_before >= 2 and all("caller=marin" in line for line in lines), lines
    assert_this_process_holds_no_peer_credentials(stack)


@pytest.mark.parametrize("cluster", CLUSTERS)
async def test_the_artifact_check_refuses_an_unauthenticated_request(
    stack: Stack, responses: Responses, cluster: str
) -> None:
    body = {"uris": [f"s3://{cluster}-artifacts/x"]}
    async with httpx.AsyncClient(base_url=stack.config.cluster(cluster).url, timeout=30) as http:
        for headers in ({}, {"Authorization": "Bearer garbage"}):
            resp = await http.post("/v1/artifacts/check", json=body, headers=headers)
            responses.add(resp.text)
            assert resp.status_code == 401, resp.text
            assert resp.json()["code"] == "UNAUTHENTICATED"


@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize(
    "body",
    [{"uris": ["s3://b/k"], "extra": 1}, {"uris": "s3://b/k"}, {}, {"uris": ["s3://b/k"] * 1025}],
    ids=["extra-field", "not-a-list", "no-uris", "too-many"],
)
async def test_the_artifact_check_refuses_a_malformed_body(
    stack: Stack, responses: Responses, cluster: str, body: object
) -> None:
    async with httpx.AsyncClient(base_url=stack.config.cluster(cluster).url, timeout=30) as http:
        resp = await http.post("/v1/artifacts/check", json=body, auth=home_auth(stack, cluster))
    responses.add(resp.text)
    assert resp.status_code == 400, resp.text
    assert resp.json()["code"] == "INVALID_ARGUMENT"


@pytest.mark.parametrize(
    ("cluster", "uri", "kind"),
    [
        ("cw-rno2a", "gs://marin-artifacts/ckpt/step-100", "S3"),
        ("cw-us-east-02a", "gs://marin-artifacts/ckpt/step-100", "S3"),
        ("marin", "s3://cw-rno2a-artifacts/data/shard-0", "GCS"),
    ],
)
async def test_the_artifact_check_uses_the_asked_controllers_own_store(
    stack: Stack, responses: Responses, cluster: str, uri: str, kind: str
) -> None:
    async with ControllerClient.for_cluster(stack.config, cluster, key_dir=stack.key_dir) as c:
        report = await c.check_artifacts([uri])
    responses.add(report.model_dump_json())
    assert report.missing == [uri]
    assert report.reasons == [
        f"Artifact {uri} is not in {cluster}'s object store ({kind}; credentials never cross clusters)"
    ]
