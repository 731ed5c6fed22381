"""Ray backend settings: validation, the demo topology on Ray, and `iris dev --ray` refusals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from iris import devstack
from iris.config import PROJECT_ROOT, BackendConfig, load_config

RAY_KEYS = {"kind", "address", "gcs_address", "ray_resources", "ray_cpus", "ray_memory_mb"}


def test_a_ray_backend_needs_an_address_and_known_tokens() -> None:
    with pytest.raises(ValidationError, match="needs address"):
        BackendConfig(id="r", kind="ray", devices={"h100": 8})
    with pytest.raises(ValidationError, match="not in devices"):
        BackendConfig(
            id="r", kind="ray", address="http://h:8265", devices={"h100": 8}, ray_resources={"a100": "x"}
        )
    b = BackendConfig(id="r", kind="ray", address="http://head:8265", devices={"H100": 8})
    assert b.ray_gcs_address == "head:6379" and b.ray_resource("h100") == "h100"
    assert BackendConfig(id="p").kind == "process"


def test_the_ray_demo_differs_from_the_demo_only_in_backend_engines() -> None:
    plain = load_config(PROJECT_ROOT / "config" / "clusters.toml")
    ray = load_config(PROJECT_ROOT / "config" / "clusters-ray.toml")
    assert plain.model_dump(exclude={"clusters"}) == ray.model_dump(exclude={"clusters"})
    kinds = {}
    for mine, theirs in zip(plain.clusters, ray.clusters, strict=True):
        assert mine.model_dump(exclude={"backends"}) == theirs.model_dump(exclude={"backends"})
        for a, b in zip(mine.backends, theirs.backends, strict=True):
            assert a.model_dump(exclude=RAY_KEYS) == b.model_dump(exclude=RAY_KEYS)
            kinds[b.id] = b.kind
    assert kinds == {
        "cpu-us-central1-a": "process",
        "cpu-us-central1-b": "process",
        "h100-us-east-02a": "ray",
        "h100-rno2a": "ray",
    }
    # One head for both peers, each with its own resource: their devices stay apart.
    (head,) = devstack.ray_heads_for(ray)
    assert head.resources == {"cw-us-east-02a/h100": 16.0, "cw-rno2a/h100": 8.0}
    assert (head.dashboard_port, head.gcs_port) == (8265, 8266)


def test_dev_ray_refuses_a_config_without_ray_backends(tmp_path: Path) -> None:
    plain = PROJECT_ROOT / "config" / "clusters.toml"
    res = subprocess.run(
        [str(Path(sys.executable).parent / "iris"), "--config", str(plain),
         "dev", "--ray", "--data-dir", str(tmp_path / "data")],
        capture_output=True, text=True, timeout=60, env={**os.environ},
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert 'no backend with kind = "ray"' in res.stderr
    assert not (tmp_path / "data").exists()  # nothing started


def test_compose_runs_cw_rno2a_on_a_ray_head_of_the_locked_version() -> None:
    import ray

    compose = yaml.safe_load((PROJECT_ROOT / "docker-compose.yml").read_text())
    prod = load_config(PROJECT_ROOT / "config" / "compose.toml")
    ray_backends = [(c.name, b) for c in prod.clusters for b in c.backends if b.kind == "ray"]
    assert [(name, b.id) for name, b in ray_backends] == [("cw-rno2a", "h100-rno2a")]
    for name, b in ray_backends:
        host = b.ray_gcs_address.rpartition(":")[0]
        service = compose["services"][host]
        # The controller's Ray client and the head speak one version: the one in uv.lock.
        assert service["image"] == f"rayproject/ray:{ray.__version__}"
        assert b.address == f"http://{host}:8265"
        assert f'--resources={{"h100": {b.devices["h100"]}}}' in service["command"]
        assert host in compose["services"][f"controller-{name}"]["depends_on"]
