"""Operator-facing guarantees: a bad config fails fast and clearly; no secret ever leaks."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from controller_harness import (
    cluster,
    federation,
    free_port,
    gpu_backend,
    key_auth,
    make_keys,
    py,
    read_all_logs,
    render_toml,
    request,
    run_controller_cli,
    signer_for,
    start_controller,
    wait_terminal,
)
from moto.server import ThreadedMotoServer
from signing import SignerAuth

from iris.controller.errors import Unauthenticated
from iris.controller.identity import generate_keypair


def _valid(tmp: Path) -> dict[str, Any]:
    return federation(
        cluster("home", auth=key_auth("home")),
        cluster("peer", backends=[gpu_backend()], auth=key_auth("peer", trusted_requesters=["home"])),
    )


def _write(tmp: Path, text: str) -> Path:
    path = tmp / "bad.toml"
    path.write_text(text)
    return path


def _with_peer_auth(tmp: Path, **auth: Any) -> str:
    cfg = _valid(tmp)
    cfg["clusters"][1]["auth"].update(auth)
    return render_toml(cfg)


CASES: list[tuple[str, Any, str]] = [
    ("missing file", None, "not found"),
    ("not toml", lambda t: "home = [", "not valid"),
    ("schema error", lambda t: render_toml(_valid(t)).replace("port = ", "port = 'x' # ", 1), "port"),
    ("unknown trusted cluster", lambda t: _with_peer_auth(t, trusted_requesters=["ghost"]), "ghost"),
    ("bad submitter pattern", lambda t: _with_peer_auth(t, allowed_submitters=["a*b"]), "allowed_submitters"),
    ("two private key sources", lambda t: _with_peer_auth(t, private_key_env="X"), "at most one"),
    (
        "missing public key file",
        lambda t: render_toml(_valid(t)).replace('"home.pub"', '"nope.pub"'),
        "nope.pub",
    ),
    (
        "garbage public key",
        lambda t: render_toml(_valid(t)).replace('"home.pub"', '"garbage.pub"'),
        "not a PEM",
    ),
    ("unknown cluster", lambda t: render_toml(_valid(t)), "unknown cluster 'mars'"),
]


@pytest.mark.parametrize(("case", "make", "expect"), CASES, ids=[c[0] for c in CASES])
def test_invalid_config_is_one_clear_line_and_exit_2(
    tmp_path: Path, case: str, make: Any, expect: str
) -> None:
    key_dir = tmp_path / "keys"
    make_keys(key_dir, "home", "peer")
    (key_dir / "garbage.pub").write_text("not a key\n")
    path = tmp_path / "missing.toml" if make is None else _write(tmp_path, make(tmp_path))
    state = tmp_path / "state"
    name = "mars" if case == "unknown cluster" else "peer"
    port = free_port()
    result = run_controller_cli(
        [
            "--config",
            str(path),
            "--cluster",
            name,
            "--state-dir",
            str(state),
            "--port",
            str(port),
            "--key-dir",
            str(key_dir),
        ]
    )
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("iris controller: ") and expect in lines[0], lines[0]
    assert not state.exists(), "nothing may be started or created"
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=1)


def test_bad_arguments_exit_2(tmp_path: Path) -> None:
    result = run_controller_cli(["--cluster", "x"])
    assert result.returncode == 2 and "--config" in result.stderr


def _pem_bodies(*pems: bytes) -> list[str]:
    """The base64 lines of PEM blocks: what would show if a key leaked in any form."""
    out = []
    for pem in pems:
        body = "".join(line for line in pem.decode().splitlines() if not line.startswith("-----"))
        out += [body, body[:24]]
    return out


async def test_no_secret_in_any_response_or_log(tmp_path: Path) -> None:
    key_dir = tmp_path / "keys"
    make_keys(key_dir, "home")
    peer_private, _ = generate_keypair(tmp_path / "peer-keys", "peer")
    (key_dir / "peer.pub").write_bytes((tmp_path / "peer-keys" / "peer.pub").read_bytes())
    s3_access, s3_secret = "AKIAEXAMPLEACCESS5f2c", "s3cr3t-value-9d1e-do-not-leak"
    peer = cluster(
        "peer",
        backends=[gpu_backend()],
        auth={
            "private_key_env": "IRIS_TEST_PEER_PRIVATE_KEY",  # key material from the environment
            "public_key_file": "peer.pub",
            "trusted_requesters": ["home"],
            "allowed_submitters": ["*"],
        },
    )
    # The peer's own S3 store (moto), which it reads with these credentials in artifact checks.
    s3_port = free_port()
    s3_url = f"http://127.0.0.1:{s3_port}"
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=s3_port, verbose=False)
    moto.start()
    s3 = boto3.client(
        "s3",
        endpoint_url=s3_url,
        region_name="us-east-1",
        aws_access_key_id=s3_access,
        aws_secret_access_key=s3_secret,
    )
    s3.create_bucket(Bucket="peer-bucket")
    s3.put_object(Bucket="peer-bucket", Key="present", Body=b"x")
    peer["object_store"] = {
        "kind": "s3",
        "bucket": "peer-bucket",
        "endpoint": s3_url,
        "access_key_env": "IRIS_TEST_S3_KEY",
        "secret_key_env": "IRIS_TEST_S3_SECRET",
    }
    cfg_path = tmp_path / "clusters.toml"
    cfg_path.write_text(render_toml(federation(cluster("home", auth=key_auth("home")), peer)))
    env = {
        "IRIS_TEST_PEER_PRIVATE_KEY": peer_private.read_text(),
        "IRIS_TEST_S3_KEY": s3_access,
        "IRIS_TEST_S3_SECRET": s3_secret,
    }
    ctl = start_controller(cfg_path, "peer", tmp_path / "state", port=peer["port"], key_dir=key_dir, env=env)
    signer = signer_for(cfg_path, "home", key_dir)
    requester_secret = "requester-env-secret-77aa"
    bodies: list[str] = []
    tokens: list[str] = []

    signed = SignerAuth(signer, "peer", tokens)

    try:
        async with httpx.AsyncClient(base_url=ctl.url, timeout=20) as http:
            dump_env = py("import os; print(sorted(os.environ.items()))")
            good = request(dump_env, job_id="sec/env", env={"TOKEN_FOR_JOB": requester_secret})
            for method, path, kw in [
                ("GET", "/v1/health", {}),
                ("GET", "/openapi.json", {}),
                ("GET", "/v1/backends", {"auth": signed}),
                ("POST", "/v1/jobs", {"auth": signed, "json": good.model_dump(mode="json")}),
                # An invalid request carrying a secret in env: the error must not echo it.
                (
                    "POST",
                    "/v1/jobs",
                    {
                        "auth": signed,
                        "json": {**good.model_dump(mode="json"), "command": [], "x": requester_secret},
                    },
                ),
                ("GET", "/v1/jobs", {"auth": signed}),
                ("GET", "/v1/backends", {"headers": {"Authorization": "Bearer garbage"}}),
            ]:
                resp = await http.request(method, path, **kw)
                assert resp.status_code < 500
                bodies.append(resp.text)
            # The first token (GET /v1/backends), replayed verbatim.
            resp = await http.get("/v1/backends", headers={"Authorization": "Bearer " + tokens[0]})
            assert resp.status_code == 401
            bodies.append(resp.text)
            # The controller signs its store requests with its own credentials: none may show.
            uris = ["s3://peer-bucket/present", "s3://peer-bucket/absent"]
            resp = await http.post("/v1/artifacts/check", auth=signed, json={"uris": uris})
            assert resp.status_code == 200 and resp.json()["missing"] == uris[1:], resp.text
            bodies.append(resp.text)
        async with ctl.client(signer) as c:
            assert (await wait_terminal(c, "sec/env")).exit_code == 0
            job_log = await read_all_logs(c, "sec/env")
            bodies.append((await c.status("sec/env")).model_dump_json())
        # The job sees what its requester sent, never the controller's own credentials.
        assert requester_secret in job_log
        assert "IRIS_TEST_S3" not in job_log and "PRIVATE_KEY" not in job_log
        async with ctl.client(None) as c:
            with pytest.raises(Unauthenticated) as err:
                await c.backends()
            bodies.append(err.value.message)
    finally:
        ctl.stop()
        moto.stop()

    secrets = [
        s3_access,
        s3_secret,
        *_pem_bodies(peer_private.read_bytes(), (key_dir / "home.key").read_bytes()),
        *tokens,
        *(t.rsplit(".", 1)[1] for t in tokens),  # the signatures alone
    ]
    controller_log = ctl.log_text()
    assert "GET /v1/backends -> 401" in controller_log  # the log did record the refusals
    haystacks = {
        "controller log": controller_log,
        "job log": job_log,
        **{f"response {i}": b for i, b in enumerate(bodies)},
    }
    for where, text in haystacks.items():
        for secret in secrets:
            assert secret not in text, f"secret leaked into {where}"
    # Nothing in the responses or the log looks like key material at all.
    for where, text in haystacks.items():
        assert not re.search(r"-----BEGIN [A-Z ]*PRIVATE KEY-----", text), where
    for where, text in {
        "controller log": controller_log,
        **{f"response {i}": b for i, b in enumerate(bodies)},
    }.items():
        assert requester_secret not in text, f"requester env value echoed in {where}"
