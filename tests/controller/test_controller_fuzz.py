"""Fuzz the controller API from its OpenAPI document: no input may cause a server error (5xx).

Two targets: a controller without auth (so generated requests reach launch, status, logs and
terminate) and one with auth, where each generated request carries a freshly signed token.
The unauthenticated target runs with an empty PATH and an unguessable backend id, so generated
commands cannot run anything on this machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from controller_harness import (
    Controller,
    cluster,
    cpu_backend,
    federation,
    gpu_backend,
    key_auth,
    make_keys,
    signer_for,
    start_controller,
    write_config,
)
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from signing import RequestsSignerAuth

from iris.controller.identity import TokenSigner

FUZZ_SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
    database=None,
)


@pytest.fixture(scope="module")
def fuzz_controllers(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Controller, Controller, TokenSigner]]:
    root = tmp_path_factory.mktemp("fuzz")
    key_dir = root / "keys"
    make_keys(key_dir, "home", "secure")
    backends = [gpu_backend(id="fuzz-backend-7f3a9c1e", slots=4), cpu_backend(id="fuzz-cpu-0b6d2e44")]
    open_peer = cluster("open", backends=backends)
    secure = cluster(
        "secure",
        backends=backends,
        auth=key_auth("secure", trusted_requesters=["home"], allowed_submitters=["*"]),
    )
    for served in (open_peer, secure):
        served["api_docs"] = True  # the schema the fuzzers read (off by default; behind auth)
    cfg = write_config(
        root / "clusters.toml", federation(cluster("home", auth=key_auth("home")), open_peer, secure)
    )
    empty_path = {"PATH": str(root / "empty-bin")}
    open_ctl = start_controller(cfg, "open", root / "open", port=open_peer["port"], env=empty_path)
    secure_ctl = start_controller(
        cfg, "secure", root / "secure", port=secure["port"], key_dir=key_dir, env=empty_path
    )
    try:
        yield open_ctl, secure_ctl, signer_for(cfg, "home", key_dir)
    finally:
        open_ctl.stop()
        secure_ctl.stop()


def fuzz(base_url: str, mode: GenerationMode, auth: requests.auth.AuthBase | None = None) -> int:
    """Run generated cases against every operation; return how many were sent."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", auth=auth)
    sent = 0
    for result in schema.get_all_operations():
        operation = result.ok()

        @FUZZ_SETTINGS
        @given(case=operation.as_strategy(generation_mode=mode))
        def check(case: Any) -> None:
            nonlocal sent
            sent += 1
            case.call_and_validate(base_url=base_url, checks=[not_a_server_error], auth=auth, timeout=30)

        try:
            check()
        except Unsatisfiable:
            # No negative input exists for an operation without parameters (e.g. /v1/health).
            assert mode is GenerationMode.NEGATIVE
    return sent


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzz_without_auth_no_server_errors(
    fuzz_controllers: tuple[Controller, Controller, TokenSigner], mode: GenerationMode
) -> None:
    assert fuzz(fuzz_controllers[0].url, mode) > 50


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzz_with_signed_requests_no_server_errors(
    fuzz_controllers: tuple[Controller, Controller, TokenSigner], mode: GenerationMode
) -> None:
    signer = fuzz_controllers[2]
    # Each request signed for exactly what is sent (method, path and query, body).
    assert fuzz(fuzz_controllers[1].url, mode, RequestsSignerAuth(signer, "secure")) > 50


def test_fuzz_targets_were_exercised(fuzz_controllers: tuple[Controller, Controller, TokenSigner]) -> None:
    """The fuzzers must have reached the service, not bounced off one gate."""
    open_log = fuzz_controllers[0].log_text()
    secure_log = fuzz_controllers[1].log_text()
    assert "POST /v1/jobs -> 400" in open_log
    assert "GET /v1/backends -> 200" in secure_log
    assert " -> 5" not in open_log and " -> 5" not in secure_log
    assert Path(fuzz_controllers[0].state_dir / "controller.db").exists()
