"""The handoff's timers in the federation config (issue 25; docs/DESIGN.md, "Errors, retries and
parking"): their defaults are the workflow's constants of the runs before ``handoff-timers-v1``
(production keeps its schedule), the view carries what the config says, and values that cannot
work are refused at load."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest

from iris import devstack
from iris.config import ConfigError, FederationConfig, load_config
from iris.reports import FederationView, gather_reports
from workflows.job import _HANDOFF_RETRY, _PROBE_FIRST, _PROBE_MAX

TIMERS = ("handoff_retry_initial_s", "handoff_retry_max_s", "parked_probe_first_s", "parked_probe_max_s")


def seconds(value: timedelta | None) -> float:
    assert value is not None
    return value.total_seconds()


def test_the_defaults_are_the_schedule_of_the_runs_before_the_patch() -> None:
    before = (
        seconds(_HANDOFF_RETRY.initial_interval),
        seconds(_HANDOFF_RETRY.maximum_interval),
        seconds(_PROBE_FIRST),
        seconds(_PROBE_MAX),
    )
    assert before == (1.0, 10.0, 15.0, 600.0)
    config = load_config()  # config/clusters.toml sets none of them
    assert tuple(getattr(config, name) for name in TIMERS) == before
    # A view recorded before the fields existed reads back as the same schedule.
    view = FederationView(home="marin", stale_after_ms=30_000, reports=[])
    assert tuple(getattr(view, name) for name in TIMERS) == before


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"handoff_retry_initial_s": 0}, "handoff_retry_initial_s: Input should be greater than 0"),
        ({"handoff_retry_max_s": 601}, "handoff_retry_max_s: Input should be less than or equal to 600"),
        ({"parked_probe_first_s": -1}, "parked_probe_first_s: Input should be greater than 0"),
        ({"parked_probe_max_s": 7200}, "parked_probe_max_s: Input should be less than or equal to 3600"),
        (
            {"handoff_retry_initial_s": 5, "handoff_retry_max_s": 2},
            "handoff_retry_max_s must be at least handoff_retry_initial_s",
        ),
        ({"parked_probe_first_s": 30, "parked_probe_max_s": 10}, "parked_probe_max_s must be at least"),
    ],
    ids=[
        "initial-zero",
        "max-too-long",
        "probe-negative",
        "probe-max-too-long",
        "max-below-initial",
        "probe",
    ],
)
def test_timers_that_cannot_work_are_refused_at_load(
    tmp_path: Path, values: dict[str, float], message: str
) -> None:
    path = tmp_path / "clusters.json"
    path.write_text(json.dumps({**load_config().model_dump(mode="json"), **values}))

    with pytest.raises(ConfigError) as refused:
        load_config(path)

    assert message in str(refused.value)


async def test_the_view_the_workflow_reads_carries_the_configured_timers() -> None:
    """gather_reports (fetch_reports' read) copies them from the config; the clusters here answer
    nobody (free ports), which changes nothing about the timers."""
    config = load_config().model_copy(deep=True)
    for cluster in config.clusters:
        cluster.port = devstack.free_port()
        cluster.auth = None
    values = {
        "handoff_retry_initial_s": 0.5,
        "handoff_retry_max_s": 4.0,
        "parked_probe_first_s": 1.0,
        "parked_probe_max_s": 2.0,
    }
    config = FederationConfig.model_validate({**config.model_dump(), **values})

    view = await gather_reports(config, timeout_s=2.0)

    assert not any(r.reachable for r in view.reports)
    assert {name: getattr(view, name) for name in TIMERS} == values
