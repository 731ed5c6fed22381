"""``POST /v1/artifacts/check`` (docs/DESIGN.md, "Artifact check"): a controller checks artifacts in
its OWN object store, with its own credentials, for any verified caller; and the worker's activity
that asks it.

The S3 service is moto, in this process, with IAM authentication enforced: an object is found only
by a request signed with valid keys. The keys live in the peer controller's environment alone (this
process never holds them), so finding an object proves the check ran with the controller's own
credentials, and a controller of the same cluster given other keys does not find it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from controller_harness import (
    Controller,
    cluster,
    federation,
    free_port,
    key_auth,
    make_keys,
    signer_for,
    start_controller,
    write_config,
)
from moto import settings as moto_settings
from moto.server import ThreadedMotoServer
from signing import SignerAuth
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.artifacts import ArtifactActivities, ArtifactInput
from iris.config import load_config
from iris.controller.client import ControllerClient
from iris.controller.errors import InvalidArgument, Unauthenticated, Unavailable
from iris.controller.identity import TokenSigner

BUCKET = "peer-artifacts"
KEY_ENV, SECRET_ENV = "IRIS_TEST_ARTIFACTS_PEER_S3_KEY", "IRIS_TEST_ARTIFACTS_PEER_S3_SECRET"
POLICY = '{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":"s3:*","Resource":"*"}]}'


@dataclass
class World:
    root: Path
    config_path: Path
    key_dir: Path
    s3_url: str
    peer_keys: dict[str, str]
    peer: Controller  # S3 store on moto, its own valid keys in its environment
    home: Controller  # no object store
    dark: Controller  # S3 store on a port nobody listens on

    def signer(self, name: str = "home") -> TokenSigner:
        return signer_for(self.config_path, name, self.key_dir)

    def client(self, ctl: Controller, name: str | None = "home") -> ControllerClient:
        return ctl.client(self.signer(name) if name else None, timeout=30)


def _s3(endpoint: str) -> dict[str, Any]:
    return {
        "kind": "s3",
        "bucket": BUCKET,
        "endpoint": endpoint,
        "access_key_env": KEY_ENV,
        "secret_key_env": SECRET_ENV,
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("artifacts")
    key_dir = root / "keys"
    make_keys(key_dir, "home", "peer", "dark")
    s3_port = free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=s3_port, verbose=False)
    moto.start()
    url = f"http://127.0.0.1:{s3_port}"
    saved_auth = moto_settings.INITIAL_NO_AUTH_ACTION_COUNT
    controllers: list[Controller] = []
    try:
        iam = boto3.client(
            "iam", endpoint_url=url, region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
        )
        iam.create_user(UserName="peer")
        iam.put_user_policy(UserName="peer", PolicyName="s3", PolicyDocument=POLICY)
        key = iam.create_access_key(UserName="peer")["AccessKey"]
        peer_keys = {KEY_ENV: key["AccessKeyId"], SECRET_ENV: key["SecretAccessKey"]}
        moto_settings.INITIAL_NO_AUTH_ACTION_COUNT = 0  # from here on, every request must be signed
        s3 = boto3.client(
            "s3",
            endpoint_url=url,
            region_name="us-east-1",
            aws_access_key_id=key["AccessKeyId"],
            aws_secret_access_key=key["SecretAccessKey"],
        )
        for bucket in (BUCKET, "peer-other"):
            s3.create_bucket(Bucket=bucket)
        s3.put_object(Bucket=BUCKET, Key="data/shard-0", Body=b"shard")
        s3.put_object(Bucket="peer-other", Key="data/shard-1", Body=b"shard")

        trusted = {"trusted_requesters": ["home"], "allowed_submitters": ["*"]}
        home = cluster("home", auth=key_auth("home", **trusted))
        peer = cluster("peer", auth=key_auth("peer", **trusted))
        peer["object_store"] = _s3(url)
        dark = cluster("dark", auth=key_auth("dark", **trusted))
        dark["object_store"] = _s3(f"http://127.0.0.1:{free_port()}")
        config_path = write_config(root / "clusters.toml", federation(home, peer, dark))
        # Never more than one attempt at the dark store: its outage answers at once.
        no_retry = {"AWS_MAX_ATTEMPTS": "1", "AWS_RETRY_MODE": "standard"}
        for name, spec, env in [
            ("peer", peer, peer_keys),
            ("home", home, {}),
            ("dark", dark, {**peer_keys, **no_retry}),
        ]:
            state = root / name
            controllers.append(
                start_controller(config_path, name, state, port=spec["port"], key_dir=key_dir, env=env)
            )
        yield World(root, config_path, key_dir, url, peer_keys, *controllers)
    finally:
        moto_settings.INITIAL_NO_AUTH_ACTION_COUNT = saved_auth
        for ctl in controllers:
            ctl.stop()
        moto.stop()


async def test_the_controller_checks_its_own_store_with_its_own_credentials(world: World) -> None:
    assert KEY_ENV not in os.environ and SECRET_ENV not in os.environ  # only the controller has them
    uris = [
        f"s3://{BUCKET}/data/shard-0",
        f"s3://{BUCKET}/data/absent",
        f"gs://{BUCKET}/data/shard-0",
        "s3://peer-other/data/shard-1",  # another bucket of the same service: same credentials
        "s3://Not_A_Bucket/data/shard-0",
        f"s3://{BUCKET}/",
    ]
    async with world.client(world.peer) as c:
        report = await c.check_artifacts(uris)
    assert report.missing == [uris[1], uris[2], uris[4], uris[5]]
    assert report.reasons == [
        f"Artifact {uris[1]} missing in peer's object store",
        f"Artifact {uris[2]} is not in peer's object store (S3; credentials never cross clusters)",
        f"Artifact {uris[4]} missing in peer's object store",
        f"Artifact {uris[5]} missing in peer's object store",
    ]
    assert not report.ok
    async with world.client(world.peer) as c:
        assert (await c.check_artifacts([])).ok
    assert "POST /v1/artifacts/check -> 200" in world.peer.log_text()


async def test_a_controller_with_other_credentials_cannot_read_the_object(world: World) -> None:
    # The same cluster's controller, given keys the store does not accept: the object is "not ours
    # to read", whatever the asking side holds.
    wrong = {KEY_ENV: "AKIAWRONGWRONGWRONG0", SECRET_ENV: "wrong-secret"}
    spec = load_config(world.config_path).cluster("peer")
    port = free_port()
    ctl = await asyncio.to_thread(
        start_controller,
        world.config_path,
        "peer",
        world.root / "peer-wrong-keys",
        port=port,
        key_dir=world.key_dir,
        env=wrong,
    )
    try:
        assert spec.object_store is not None and spec.object_store.endpoint == world.s3_url
        uri = f"s3://{BUCKET}/data/shard-0"
        async with world.client(ctl) as c:
            report = await c.check_artifacts([uri])
        assert report.reasons == [f"Artifact {uri} missing in peer's object store"]
    finally:
        await asyncio.to_thread(ctl.stop)


async def test_a_cluster_without_an_object_store_says_so(world: World) -> None:
    uri = "gs://anything/at/all"
    async with world.client(world.home) as c:
        report = await c.check_artifacts([uri])
    assert report.reasons == [f"Artifact {uri} cannot be checked: home has no object store"]


async def test_a_store_outage_is_unavailable(world: World) -> None:
    async with world.client(world.dark) as c:
        with pytest.raises(Unavailable) as err:
            await c.check_artifacts([f"s3://{BUCKET}/data/shard-0"])
    assert err.value.retryable
    async with httpx.AsyncClient(base_url=world.dark.url, timeout=30) as http:
        resp = await http.post(
            "/v1/artifacts/check",
            json={"uris": [f"s3://{BUCKET}/data/shard-0"]},
            auth=SignerAuth(world.signer(), "dark"),
        )
    assert resp.status_code == 503, resp.text
    body = resp.json()
    assert body["code"] == "UNAVAILABLE" and "dark's object store is unavailable" in body["message"], body
    # A wrong scheme needs no store: still answered during the outage.
    async with world.client(world.dark) as c:
        assert not (await c.check_artifacts([f"gs://{BUCKET}/x"])).ok


async def test_only_a_verified_caller_may_ask(world: World) -> None:
    body = {"uris": [f"s3://{BUCKET}/data/shard-0"]}
    async with httpx.AsyncClient(base_url=world.peer.url, timeout=30) as http:
        anonymous = await http.post("/v1/artifacts/check", json=body)
        # The peer's own key: a real federation member, but not one the peer trusts to ask.
        untrusted = await http.post(
            "/v1/artifacts/check", json=body, auth=SignerAuth(world.signer("peer"), "peer")
        )
    for resp in (anonymous, untrusted):
        assert resp.status_code == 401, resp.text
        assert resp.json()["code"] == "UNAUTHENTICATED"
    async with world.client(world.peer, None) as c:
        with pytest.raises(Unauthenticated):
            await c.check_artifacts([f"s3://{BUCKET}/data/shard-0"])


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"uris": "s3://peer-artifacts/data/shard-0"},
        {"uris": [7]},
        {"uris": [], "extra": True},
        {"uris": ["s3://peer-artifacts/x"] * 1025},
        {"uris": ["s3://peer-artifacts/" + "x" * 1005]},  # 1025 characters
        ["s3://peer-artifacts/data/shard-0"],
    ],
    ids=["no-uris", "string", "not-strings", "extra-field", "1025-uris", "1025-chars", "bare-list"],
)
async def test_a_malformed_request_is_invalid_argument(world: World, body: Any) -> None:
    async with httpx.AsyncClient(base_url=world.peer.url, timeout=30) as http:
        resp = await http.post("/v1/artifacts/check", json=body, auth=SignerAuth(world.signer(), "peer"))
    assert resp.status_code == 400, resp.text
    assert resp.json()["code"] == "INVALID_ARGUMENT"
    assert "s3://" not in resp.json()["message"]  # the input is never echoed


async def test_the_limits_are_inclusive(world: World) -> None:
    uris = [f"s3://{BUCKET}/" + "x" * (1024 - len(f"s3://{BUCKET}/"))] + [f"gs://{BUCKET}/y"] * 1023
    async with world.client(world.peer) as c:
        report = await c.check_artifacts(uris)
    assert len(uris[0]) == 1024 and len(report.missing) == 1024
    async with world.client(world.peer) as c:
        with pytest.raises(InvalidArgument):
            await c.check_artifacts([*uris, uris[-1]])


# ---- the worker's activity: it asks the destination's controller ------------------------------


async def test_the_activity_reports_what_the_controller_says(open_controller: Controller) -> None:
    acts = ArtifactActivities(load_config(open_controller.config_path))
    env = ActivityEnvironment()
    uri = "s3://peer-artifacts/data/shard-0"
    report = await env.run(acts.check_artifacts, ArtifactInput(cluster="peer", uris=[uri]))
    assert report.reasons == [f"Artifact {uri} cannot be checked: peer has no object store"]


async def test_the_activity_retries_outages_and_not_refusals(open_controller: Controller) -> None:
    config = load_config(open_controller.config_path)
    acts = ArtifactActivities(config)
    env = ActivityEnvironment()
    with pytest.raises(ApplicationError) as refused:
        # Any number of URIs is sent (in batches the endpoint takes); one it refuses is final.
        await env.run(acts.check_artifacts, ArtifactInput(cluster="peer", uris=["s3://b/k" + "x" * 2000]))
    assert refused.value.non_retryable and "peer refused the artifact check" in refused.value.message
    with pytest.raises(ApplicationError) as unknown:
        await env.run(acts.check_artifacts, ArtifactInput(cluster="nowhere", uris=[]))
    assert unknown.value.non_retryable
    down = config.model_copy(deep=True)
    down.cluster("peer").port = free_port()  # nobody listens: the controller is unavailable
    with pytest.raises(Unavailable):  # raised as is: Temporal retries it
        await env.run(
            ArtifactActivities(down).check_artifacts, ArtifactInput(cluster="peer", uris=["s3://b/k"])
        )
