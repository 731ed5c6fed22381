"""docker-compose.yml validates offline and agrees with the embedded stack."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from iris.config import PROJECT_ROOT, FederationConfig, load_config
from iris.contract import SEARCH_ATTRIBUTES

COMPOSE_FILE = PROJECT_ROOT / "docker-compose.yml"
# The secrets the file requires from the operator's environment (values for validation only).
VALIDATION_ENV = {
    "MINIO_ROOT_PASSWORD": "validation-root-secret",
    "CW_US_EAST_02A_S3_SECRET": "validation-east-secret",
    "CW_RNO2A_S3_SECRET": "validation-rno-secret",
}


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
        env={**os.environ, **VALIDATION_ENV},
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
    assert all(c.auth is not None for c in prod.clusters)  # every controller has auth on


def test_project_image_installs_from_the_lock() -> None:
    dockerfile = (PROJECT_ROOT / "Dockerfile").read_text()
    assert "uv sync --frozen" in dockerfile
    assert "config/compose.toml" in dockerfile


# ---- secure by default (issue 16, acceptance 6; docs/DESIGN.md, "Where secrets live") ----------

# Published only on loopback unless an override file asks: Temporal, its Web UI, PostgreSQL, MinIO.
SENSITIVE_IMAGES = ("temporalio/server", "temporalio/ui", "postgres", "minio/minio")
SENSITIVE_PORTS = {7233, 8080, 8233, 5432, 9000, 9001}
LOOPBACK = {"127.0.0.1", "::1", "localhost"}
TEMPORAL_TLS = {
    "TEMPORAL_TLS_REQUIRE_CLIENT_AUTH": "true",
    "TEMPORAL_TLS_FRONTEND_CERT": None,
    "TEMPORAL_TLS_FRONTEND_KEY": None,
    "TEMPORAL_TLS_CLIENT1_CA_CERT": None,
}


def normalized(*files: Path) -> dict[str, Any]:
    """The file(s) as compose-go resolves them (merges, anchors, short port syntax, interpolation)."""
    args = [str(_compose_bin())]
    for f in files:
        args += ["-f", str(f)]
    res = subprocess.run(
        [*args, "config", "--format", "json"],
        capture_output=True,
        text=True,
        env={**os.environ, **VALIDATION_ENV},
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    loaded: dict[str, Any] = json.loads(res.stdout)
    return loaded


def exposed_ports(project: dict[str, Any]) -> list[str]:
    """Every port of a sensitive service published beyond loopback (no host ip means all)."""
    found = []
    for name, svc in project["services"].items():
        image = str(svc.get("image", ""))
        for port in svc.get("ports") or []:
            if not port.get("published"):
                continue
            sensitive = image.startswith(SENSITIVE_IMAGES) or int(port["target"]) in SENSITIVE_PORTS
            if sensitive and port.get("host_ip", "") not in LOOPBACK:
                found.append(
                    f"{name}: {port.get('host_ip') or '0.0.0.0'}:{port['published']}->{port['target']}"
                )
    return found


def temporal_tls_gaps(project: dict[str, Any], config: FederationConfig) -> list[str]:
    """Where Temporal, or a client of it, runs without mutual TLS."""
    found = []
    servers = [
        n for n, s in project["services"].items() if str(s.get("image", "")).startswith("temporalio/server")
    ]
    if not servers:
        found.append("no Temporal server service")
    for name in servers:
        env = project["services"][name].get("environment") or {}
        for var, wanted in TEMPORAL_TLS.items():
            value = env.get(var)
            if not value or (wanted is not None and str(value).lower() != wanted):
                found.append(f"{name}: {var} is {value!r}")
    tls = config.temporal.tls
    if tls is None or not (tls.server_ca and tls.client_cert and tls.client_key):
        found.append("config/compose.toml: the worker connects to Temporal without mutual TLS")
    for name, svc in project["services"].items():
        env = svc.get("environment") or {}
        if str(svc.get("image", "")).startswith("temporalio/ui") and not env.get("TEMPORAL_TLS_CERT"):
            found.append(f"{name}: the Web UI connects to Temporal without a client certificate")
    return found


def secret_leaks(project: dict[str, Any], config: FederationConfig) -> list[str]:
    """A process of one cluster holding another cluster's key volume or store credentials, or
    MinIO's root credentials."""
    found = []
    key_volumes = {f"keys-{c.name}": c.name for c in config.clusters}
    cred_vars = {
        var: c.name
        for c in config.clusters
        if c.object_store is not None
        for var in (c.object_store.access_key_env, c.object_store.secret_key_env)
        if var
    }
    owners = {c.host: c.name for c in config.clusters} | {"worker": config.home}
    for name, owner in owners.items():
        svc = project["services"][name]
        mounts = [v["source"] for v in svc.get("volumes") or [] if v.get("type") == "volume"]
        if [v for v in mounts if v in key_volumes] != [f"keys-{owner}"]:
            found.append(f"{name}: key volumes {mounts}, not only keys-{owner}")
        env = svc.get("environment") or {}
        found += [f"{name}: {var} ({cred_vars[var]}'s)" for var in env if cred_vars.get(var, owner) != owner]
        if VALIDATION_ENV["MINIO_ROOT_PASSWORD"] in {str(v) for v in env.values()}:
            found.append(f"{name}: MinIO's root password")
    return found


@pytest.fixture(scope="module")
def prod_config() -> FederationConfig:
    return load_config(PROJECT_ROOT / "config" / "compose.toml")


def test_compose_is_secure_by_default(prod_config: FederationConfig) -> None:
    project = normalized(COMPOSE_FILE)
    assert exposed_ports(project) == []
    assert temporal_tls_gaps(project, prod_config) == []
    assert secret_leaks(project, prod_config) == []
    # Published at all, then on loopback: Temporal's frontend and its Web UI.
    published = {p["target"] for n in ("temporal", "temporal-ui") for p in project["services"][n]["ports"]}
    assert published == {7233, 8080}


def _mutated(tmp_path: Path, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    change(data)
    path = tmp_path / "docker-compose.yml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return normalized(path)


@pytest.mark.parametrize(
    ("service", "port"),
    [
        ("temporal", "7233:7233"),  # no host ip: every interface
        ("temporal", "0.0.0.0:7233:7233"),
        ("temporal-ui", "0.0.0.0:8080:8080"),
        ("postgresql", "5432:5432"),
        ("minio", "9000:9000"),
        ("minio", {"target": 9001, "published": "9001"}),
    ],
)
def test_a_sensitive_port_on_every_interface_fails_validation(
    tmp_path: Path, service: str, port: str | dict[str, Any]
) -> None:
    def publish(data: dict[str, Any]) -> None:
        ports = data["services"][service].setdefault("ports", [])
        ports[:] = [port]

    assert exposed_ports(_mutated(tmp_path, publish)) != []


def test_an_override_file_may_publish_more(tmp_path: Path) -> None:
    override = tmp_path / "docker-compose.override.yml"
    override.write_text('services:\n  minio:\n    ports: ["127.0.0.1:9001:9001"]\n')
    assert exposed_ports(normalized(COMPOSE_FILE, override)) == []


@pytest.mark.parametrize(
    "change",
    [
        "TEMPORAL_TLS_REQUIRE_CLIENT_AUTH=false",
        "-TEMPORAL_TLS_REQUIRE_CLIENT_AUTH",
        "-TEMPORAL_TLS_FRONTEND_CERT",
        "-TEMPORAL_TLS_CLIENT1_CA_CERT",
    ],
)
def test_temporal_without_tls_fails_validation(
    tmp_path: Path, prod_config: FederationConfig, change: str
) -> None:
    def weaken(data: dict[str, Any]) -> None:
        env = data["services"]["temporal"]["environment"]
        if change.startswith("-"):
            del env[change[1:]]
        else:
            var, _, value = change.partition("=")
            env[var] = value

    assert temporal_tls_gaps(_mutated(tmp_path, weaken), prod_config) != []


def test_a_plaintext_worker_or_ui_fails_validation(tmp_path: Path, prod_config: FederationConfig) -> None:
    plaintext = prod_config.model_copy(deep=True)
    plaintext.temporal.tls = None
    assert temporal_tls_gaps(normalized(COMPOSE_FILE), plaintext) != []

    def no_ui_cert(data: dict[str, Any]) -> None:
        del data["services"]["temporal-ui"]["environment"]["TEMPORAL_TLS_CERT"]

    assert temporal_tls_gaps(_mutated(tmp_path, no_ui_cert), prod_config) != []


@pytest.mark.parametrize(
    ("service", "change"),
    [
        ("controller-cw-rno2a", "volume keys-marin:/home-keys:ro"),
        ("worker", "volume keys-cw-rno2a:/peer-keys:ro"),
        ("controller-cw-rno2a", "env IRIS_CW_US_EAST_02A_S3_SECRET=${CW_US_EAST_02A_S3_SECRET}"),
        ("worker", "env IRIS_CW_RNO2A_S3_SECRET=${CW_RNO2A_S3_SECRET}"),
        ("controller-cw-us-east-02a", "env IRIS_CW_US_EAST_02A_S3_SECRET=${MINIO_ROOT_PASSWORD}"),
    ],
)
def test_a_process_given_another_clusters_secret_fails_validation(
    tmp_path: Path, prod_config: FederationConfig, service: str, change: str
) -> None:
    def leak(data: dict[str, Any]) -> None:
        svc = data["services"][service]
        kind, _, what = change.partition(" ")
        if kind == "volume":
            svc["volumes"] = [*svc.get("volumes", []), what]
        else:
            var, _, value = what.partition("=")
            svc["environment"] = {**(svc.get("environment") or {}), var: value}

    assert secret_leaks(_mutated(tmp_path, leak), prod_config) != []
