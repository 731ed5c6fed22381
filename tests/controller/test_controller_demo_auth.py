"""The demo topology (config/clusters.toml) with signed handoffs, bootstrapped with no manual step.

This is the path ``iris dev`` takes: ``ensure_cluster_keys`` creates missing key pairs under the
data dir, controllers find them through ``$IRIS_KEY_DIR`` and clients sign with
``ControllerClient.for_cluster``.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
from controller_harness import (
    PROJECT_ROOT,
    TEST_USER,
    free_port,
    py,
    read_all_logs,
    render_toml,
    start_controller,
    wait_terminal,
)

from iris.config import load_config
from iris.controller.client import ControllerClient
from iris.controller.errors import Unauthenticated
from iris.controller.identity import ensure_cluster_keys
from iris.controller.models import ControllerJobState as S
from iris.controller.models import LaunchRequest
from iris.policy.models import DeviceRequest

# The auth sections documented in iris/controller/README.md for the demo clusters.
DEMO_AUTH: dict[str, dict[str, Any]] = {
    name: {
        "private_key_file": f"{name}.key",
        "public_key_file": f"{name}.pub",
        "trusted_requesters": ["marin"],
        "allowed_submitters": ["*"],
    }
    for name in ("marin", "cw-us-east-02a", "cw-rno2a")
}


def demo_config_with_auth(tmp: Path) -> Path:
    data = tomllib.loads((PROJECT_ROOT / "config" / "clusters.toml").read_text())
    for c in data["clusters"]:
        c["port"] = free_port()
        c.setdefault("auth", DEMO_AUTH[c["name"]])
        c["run_as"] = TEST_USER  # the job runs this test interpreter (controller_harness.TEST_USER)
    path = tmp / "clusters.toml"
    path.write_text(render_toml(data))
    return path


async def test_demo_keys_are_generated_and_handoffs_are_signed(tmp_path: Path) -> None:
    cfg_path = demo_config_with_auth(tmp_path)
    config = load_config(cfg_path)
    key_dir = tmp_path / "data" / "keys"
    assert sorted(ensure_cluster_keys(config, key_dir)) == ["cw-rno2a", "cw-us-east-02a", "marin"]
    assert ensure_cluster_keys(config, key_dir) == []  # idempotent on the next start
    assert (key_dir / "marin.key").stat().st_mode & 0o077 == 0  # private keys are owner-only

    peer = config.cluster("cw-us-east-02a")
    ctl = start_controller(
        cfg_path,
        peer.name,
        tmp_path / "data" / "clusters" / peer.name,
        port=peer.port,
        env={"IRIS_KEY_DIR": str(key_dir)},
    )
    try:
        req = LaunchRequest(
            job_id="alice/h100-demo",
            command=py("print(42)"),
            device=DeviceRequest(type="gpu", variant="h100", count=8),
            user="alice@example.com",
            requester="marin",
            nonce="n-1",
            backend_id="h100-us-east-02a",
        )
        async with ControllerClient.for_cluster(config, peer.name, key_dir=key_dir) as c:
            assert (await c.launch(req)).requester == "marin"
            assert (await wait_terminal(c, req.job_id)).state is S.SUCCEEDED
            assert await read_all_logs(c, req.job_id) == "42\n"
        # A peer is not a trusted requester of another peer.
        async with ControllerClient.for_cluster(
            config, peer.name, as_cluster="cw-rno2a", key_dir=key_dir
        ) as c:
            with pytest.raises(Unauthenticated):
                await c.backends()
    finally:
        ctl.stop()
