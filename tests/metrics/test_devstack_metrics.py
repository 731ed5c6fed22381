"""`iris dev`'s metrics plumbing, service-free (iris/devstack.py; docs/DESIGN.md, "Metrics"): the
Temporal dev server gets --metrics-port, every endpoint is a scrape target under the jobs the
dashboard and docker-compose's Prometheus use, and the generated config names them all."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from iris import devstack
from iris.config import load_config


def test_temporal_is_started_with_the_metrics_port(tmp_path: Path) -> None:
    cfg = load_config()
    argv = list(devstack.temporal_server(cfg, tmp_path, db_file=None, metrics_port=9999).argv)
    assert argv[argv.index("--metrics-port") + 1] == "9999"
    assert "--metrics-port" not in devstack.temporal_server(cfg, tmp_path, db_file=None).argv


def test_every_endpoint_is_a_target_and_the_config_scrapes_them() -> None:
    cfg = load_config()
    targets = devstack.metrics_targets(cfg, "127.0.0.1:9464", 9465)
    assert [(t.name, t.url) for t in targets] == [
        ("worker", "http://127.0.0.1:9464/metrics"),
        *((f"controller {c.name}", f"http://{c.host}:{c.port}/metrics") for c in cfg.clusters),
        ("Temporal", "http://127.0.0.1:9465/metrics"),
    ]
    scrape = yaml.safe_load(devstack.prometheus_config(targets, scrape_interval_s=2))
    assert scrape["global"]["scrape_interval"] == "2s"
    jobs = {j["job_name"]: j["static_configs"] for j in scrape["scrape_configs"]}
    assert jobs[devstack.WORKER_JOB] == [{"targets": ["127.0.0.1:9464"]}]
    assert jobs[devstack.TEMPORAL_JOB] == [{"targets": ["127.0.0.1:9465"]}]
    assert jobs[devstack.CONTROLLER_JOB] == [
        {"targets": [f"{c.host}:{c.port}"], "labels": {"cluster": c.name}} for c in cfg.clusters
    ]


@pytest.mark.parametrize("bad", ["nope", "127.0.0.1", ":9464", "127.0.0.1:", "host:0", "host:65536", "h:x1"])
def test_an_address_that_is_not_host_port_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="is not HOST:PORT"):
        devstack.host_port(bad)


def test_host_port() -> None:
    assert devstack.host_port(" 0.0.0.0:9464 ") == ("0.0.0.0", 9464)
