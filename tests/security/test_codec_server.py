"""The codec server (iris/codecserver.py), service-free: Temporal's codec protocol behind a token,
CORS for the Web UI's origin only (docs/SECURITY.md, "Payload encryption")."""

from __future__ import annotations

import stat
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from google.protobuf import json_format
from temporalio.api.common.v1 import Payloads

from iris.codecserver import create_app, ensure_token
from iris.payloadcodec import EncryptionCodec, Keyring
from iris.temporal import data_converter

TOKEN = "t0ken-for-the-codec-server-test"
UI = "http://localhost:8233"
SECRET = "hunter2-alice"
RING = Keyring.generate()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(RING, TOKEN, [UI])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://codec") as client:
        yield client


async def sealed_body() -> str:
    payloads = await data_converter(RING).encode([{"env": {"SECRET_TOKEN_ALICE": SECRET}}])
    return json_format.MessageToJson(Payloads(payloads=payloads))


def values(body: str) -> list[object]:
    message = json_format.Parse(body, Payloads())
    return data_converter().payload_converter.from_payloads(list(message.payloads))


async def test_decode_with_the_token_as_header_or_path_segment(http: httpx.AsyncClient) -> None:
    body = await sealed_body()
    assert SECRET not in body
    for path, headers in (
        ("/decode", {"Authorization": f"Bearer {TOKEN}"}),
        (f"/{TOKEN}/decode", {}),  # the Web UI's endpoint setting: http://host:port/<token>
        (f"/{TOKEN}/default/decode", {}),  # the CLI's {namespace} templating
    ):
        answer = await http.post(path, content=body, headers={**headers, "X-Namespace": "default"})
        assert answer.status_code == 200, (path, answer.text)
        assert values(answer.text) == [{"env": {"SECRET_TOKEN_ALICE": SECRET}}]


async def test_encode_gives_what_the_worker_reads(http: httpx.AsyncClient) -> None:
    plain = await data_converter().encode([{"command": ["true"]}])
    body = json_format.MessageToJson(Payloads(payloads=plain))
    answer = await http.post("/encode", content=body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 200, answer.text
    encoded = list(json_format.Parse(answer.text, Payloads()).payloads)
    assert encoded[0].metadata["encoding"] == b"binary/encrypted"
    assert await EncryptionCodec(RING).decode(encoded) == plain


async def test_without_the_token_nothing_is_decoded(http: httpx.AsyncClient) -> None:
    body = await sealed_body()
    for path, headers in (
        ("/decode", {}),
        ("/decode", {"Authorization": "Bearer not-the-token"}),
        ("/not-the-token/decode", {}),
        (f"/{TOKEN[:-1]}/decode", {}),
    ):
        answer = await http.post(path, content=body, headers=headers)
        assert answer.status_code == 401, (path, answer.text)
        assert SECRET not in answer.text
    assert (await http.post(f"/{TOKEN}/other", content=body)).status_code == 404
    assert (await http.get(f"/{TOKEN}/decode")).status_code == 405


async def test_bad_input_and_unknown_keys_are_400(http: httpx.AsyncClient) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert (await http.post("/decode", content=b"{not json", headers=auth)).status_code == 400
    foreign = await data_converter(Keyring.generate()).encode([{"x": 1}])
    body = json_format.MessageToJson(Payloads(payloads=foreign))
    answer = await http.post("/decode", content=body, headers=auth)
    assert answer.status_code == 400 and "lacks" in answer.json()["error"]
    # A history recorded before encryption: its payloads come back as they are.
    plain = await data_converter().encode([{"x": 1}])
    body = json_format.MessageToJson(Payloads(payloads=plain))
    answer = await http.post("/decode", content=body, headers=auth)
    assert answer.status_code == 200 and values(answer.text) == [{"x": 1}]


async def test_cors_admits_the_web_ui_origin_only(http: httpx.AsyncClient) -> None:
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,x-namespace,authorization",
    }
    ok = await http.options(f"/{TOKEN}/decode", headers={"Origin": UI, **preflight})
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == UI
    assert "x-namespace" in ok.headers["access-control-allow-headers"].lower()
    other = await http.options(f"/{TOKEN}/decode", headers={"Origin": "http://evil.example", **preflight})
    assert other.headers.get("access-control-allow-origin") is None
    answer = await http.post(f"/{TOKEN}/decode", content=await sealed_body(), headers={"Origin": UI})
    assert answer.headers["access-control-allow-origin"] == UI


def test_the_token_file_is_created_once_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "ring" / "codec-server.token"
    token = ensure_token(path)
    assert len(token) >= 32 and ensure_token(path) == token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(ValueError, match="16 characters"):
        create_app(RING, "short", [UI])
