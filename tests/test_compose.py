"""docker-compose.yml validates offline and agrees with the embedded stack."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from iris.config import PROJECT_ROOT, load_config
from iris.contract import SEARCH_ATTRIBUTES

COMPOSE_FILE = PROJECT_ROOT / "docker-compose.yml"


def _compose_bin() -> Path:
    import compose

    path = Path(compose.__file__).parent / "docker-compose"
    assert path.exists(), path
    return path


def _validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(_compose_bin()), "-f", str(path), "config", "-q"],
        capture_output=True,
        text=True,
        env={**os.environ, "MINIO_ROOT_PASSWORD": "validation-only"},
        timeout=60,
    )


def test_compose_file_validates() -> None:
    res = _validate(COMPOSE_FILE)
    assert res.returncode == 0, res.stderr


def test_validator_rejects_a_broken_file(tmp_path: Path) -> None:
    broken = tmp_path / "docker-compose.yml"
    broken.write_text("services:\n  x:\n    image: a\n    depends_on: [missing]\n")
    assert _validate(broken).returncode != 0


@pytest.fixture(scope="module")
def compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load(COMPOSE_FILE.read_text())


def test_every_search_attribute_is_bootstrapped(compose: dict) -> None:  # type: ignore[type-arg]
    script = " ".join(compose["services"]["temporal-bootstrap"]["command"])
    for name, kind in SEARCH_ATTRIBUTES.items():
        assert f"--name {name} --type {kind}" in script


def test_compose_topology_matches_the_embedded_stack(compose: dict) -> None:  # type: ignore[type-arg]
    embedded = load_config(PROJECT_ROOT / "config" / "clusters.toml")
    prod = load_config(PROJECT_ROOT / "config" / "compose.toml")
    assert prod.home == embedded.home
    assert prod.cluster_names == embedded.cluster_names
    # Where a backend's jobs run (processes here, a Ray service there) may differ; its shape may not.
    engine = {"kind", "address", "gcs_address", "ray_resources", "ray_cpus", "ray_memory_mb"}
    for mine, theirs in zip(embedded.clusters, prod.clusters, strict=True):
        assert [b.model_dump(exclude=engine) for b in mine.backends] == [
            b.model_dump(exclude=engine) for b in theirs.backends
        ], mine.name
        assert mine.auth == theirs.auth, mine.name
        assert mine.object_store is not None and theirs.object_store is not None
        assert (mine.object_store.kind, mine.object_store.bucket) == (
            theirs.object_store.kind,
            theirs.object_store.bucket,
        )
        service = compose["services"][theirs.host]
        assert "--cluster" in service["command"] and theirs.name in service["command"]
        assert str(theirs.port) in " ".join(service["healthcheck"]["test"])
    assert "worker" in compose["services"]
    for service in ("worker", *(c.host for c in prod.clusters)):
        assert "iris-keys:/keys:ro" in compose["services"][service]["volumes"], service


def test_project_image_installs_from_the_lock() -> None:
    dockerfile = (PROJECT_ROOT / "Dockerfile").read_text()
    assert "uv sync --frozen" in dockerfile
    assert "config/compose.toml" in dockerfile
