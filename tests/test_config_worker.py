"""``[worker] max_cached_workflows`` (issue 31; docs/DESIGN.md, "Worker memory"): the worker's
sticky cache is the config's size, the default stays what the worker held before, and a size that
cannot work is refused at load with one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pytest
from temporalio.client import Client

import worker.main as worker_main
from iris.config import ConfigError, load_config
from iris.store import FederationStore


def test_the_default_is_the_cache_the_worker_held_before() -> None:
    assert load_config().worker.max_cached_workflows == 4096  # config/clusters.toml sets none


@pytest.mark.parametrize(
    ("size", "message"),
    [
        (0, "worker.max_cached_workflows: Input should be greater than or equal to 1"),
        ("many", "valid integer"),
    ],
)
def test_a_cache_size_that_cannot_work_is_refused_at_load(tmp_path: Path, size: object, message: str) -> None:
    path = tmp_path / "clusters.json"
    path.write_text(
        json.dumps({**load_config().model_dump(mode="json"), "worker": {"max_cached_workflows": size}})
    )

    with pytest.raises(ConfigError) as refused:
        load_config(path)

    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_the_jobs_worker_caches_as_many_workflows_as_configured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What build_worker asks of the SDK's Worker, by task queue (a Worker needs a connected
    client; its constructor is the boundary checked here)."""
    asked: dict[str, dict[str, Any]] = {}

    class Recorded:
        def __init__(self, client: object, **kwargs: Any) -> None:
            asked[kwargs["task_queue"]] = kwargs

    monkeypatch.setattr(worker_main, "Worker", Recorded)
    config = load_config().model_copy(deep=True)
    config.worker.max_cached_workflows = 250
    store = FederationStore(f"sqlite:///{tmp_path / 'federation.db'}")
    worker_main.build_worker(cast(Client, object()), config, store)

    jobs = asked[config.temporal.task_queue]
    assert jobs["max_cached_workflows"] == 250
    assert sum(1 for kw in asked.values() if kw.get("max_cached_workflows") == 250) == 1  # not the manager's
