"""``[worker]`` (issue 31; docs/DESIGN.md, "Worker memory"): the worker's sticky cache is the
config's size, the default stays what the worker held before, its workflow task polls scale up to
``max_workflow_task_polls`` when that is set, and a value that cannot work is refused at load with
one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pytest
from temporalio.client import Client
from temporalio.worker import PollerBehaviorAutoscaling

import worker.main as worker_main
from iris.config import ConfigError, load_config
from iris.store import FederationStore


def test_the_default_is_the_cache_the_worker_held_before() -> None:
    assert load_config().worker.max_cached_workflows == 4096  # config/clusters.toml sets none


@pytest.mark.parametrize(
    ("setting", "size", "message"),
    [
        (
            "max_cached_workflows",
            0,
            "worker.max_cached_workflows: Input should be greater than or equal to 1",
        ),
        ("max_cached_workflows", "many", "valid integer"),
        # One poll for each of the sticky and the non-sticky queue at the least.
        (
            "max_workflow_task_polls",
            1,
            "worker.max_workflow_task_polls: Input should be greater than or equal to 2",
        ),
    ],
)
def test_a_worker_setting_that_cannot_work_is_refused_at_load(
    tmp_path: Path, setting: str, size: object, message: str
) -> None:
    path = tmp_path / "clusters.json"
    path.write_text(json.dumps({**load_config().model_dump(mode="json"), "worker": {setting: size}}))

    with pytest.raises(ConfigError) as refused:
        load_config(path)

    assert message in str(refused.value) and "\n" not in str(refused.value)


def recorded_workers(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, Any]]:
    """What build_worker asks of the SDK's Worker, by task queue, filled as it builds (a Worker
    needs a connected client; its constructor is the boundary checked here)."""
    asked: dict[str, dict[str, Any]] = {}

    class Recorded:
        def __init__(self, client: object, **kwargs: Any) -> None:
            asked[kwargs["task_queue"]] = kwargs

    monkeypatch.setattr(worker_main, "Worker", Recorded)
    return asked


def test_the_jobs_worker_caches_as_many_workflows_as_configured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = recorded_workers(monkeypatch)
    config = load_config().model_copy(deep=True)
    config.worker.max_cached_workflows = 250
    store = FederationStore(f"sqlite:///{tmp_path / 'federation.db'}")
    worker_main.build_worker(cast(Client, object()), config, store)

    jobs = asked[config.temporal.task_queue]
    assert jobs["max_cached_workflows"] == 250
    assert sum(1 for kw in asked.values() if kw.get("max_cached_workflows") == 250) == 1  # not the manager's


def test_the_jobs_worker_scales_its_workflow_task_polls_only_when_configured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unset, the SDK's fixed five polls; set, autoscaling polls up to that many, for a worker
    holding more running jobs than its cache (docs/BENCHMARKS.md, "A third try")."""
    asked = recorded_workers(monkeypatch)
    config = load_config().model_copy(deep=True)
    store = FederationStore(f"sqlite:///{tmp_path / 'f.db'}")
    assert config.worker.max_workflow_task_polls is None
    worker_main.build_worker(cast(Client, object()), config, store)
    assert "workflow_task_poller_behavior" not in asked[config.temporal.task_queue]

    config.worker.max_workflow_task_polls = 40
    worker_main.build_worker(cast(Client, object()), config, store)
    polls = asked[config.temporal.task_queue]["workflow_task_poller_behavior"]
    assert polls == PollerBehaviorAutoscaling(maximum=40)
    assert "max_concurrent_workflow_task_polls" not in asked[config.temporal.task_queue]  # it would override
    assert all(
        "workflow_task_poller_behavior" not in kw
        for q, kw in asked.items()
        if q != config.temporal.task_queue
    )
