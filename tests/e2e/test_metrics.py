"""A real Prometheus scrapes `iris dev` (issue 18, acceptance 1; docs/DESIGN.md, "Metrics").

`iris dev` runs on free ports with its worker's and Temporal's metrics ports given; it prints every
metrics endpoint and writes a Prometheus config. Debian's prometheus (scripts/install-prometheus.sh,
which .ci/run calls) scrapes that config's targets every second: the worker, every controller and
Temporal, all up. Then, after a job spilled to a peer, a rejected one, one refused by its pinned peer
and a queued one cancelled, PromQL finds each iris_* metric with the labels the events give it, and
every metric the Grafana dashboard (deploy/grafana/) queries exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from dashboard import dashboard_metric_names, expressions
from devprocess import DevProcess
from stack import PROJECT_ROOT, VENV_BIN, free_port_config
from temporalio.testing import WorkflowEnvironment

from iris import devstack, metrics
from iris.config import load_config
from iris.contract import SEARCH_ATTRIBUTE_KEYS
from iris.policy.reasons import ReasonCode

PROMETHEUS = PROJECT_ROOT / ".data" / "prometheus" / "usr" / "bin" / "prometheus"
USER = "metrics-user"
Result = list[dict[str, Any]]


def prometheus_binary() -> Path | None:
    if PROMETHEUS.exists():
        return PROMETHEUS
    found = shutil.which("prometheus")
    return Path(found) if found else None


class Prometheus:
    """A Prometheus server of this test's own, on a free loopback port."""

    def __init__(self, binary: Path, config: Path, root: Path) -> None:
        self.port = devstack.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / "prometheus.log"
        self.argv = [
            str(binary),
            f"--config.file={config}",
            f"--storage.tsdb.path={root / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)

    async def get(self, path: str, **params: str) -> Any:
        async with httpx.AsyncClient(base_url=self.url, timeout=10) as http:
            resp = await http.get(path, params=params)
        resp.raise_for_status()
        body = resp.json()
        assert body["status"] == "success", body
        return body["data"]

    async def query(self, promql: str) -> Result:
        data = await self.get("/api/v1/query", query=promql)
        result: Result = data["result"]
        return result


async def eventually(
    check: Callable[[], Awaitable[Any]], what: str, *, timeout: float = 60.0, interval: float = 0.5
) -> Any:
    """Poll ``check`` until it returns something truthy; fail naming ``what`` and the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def value(result: Result) -> float:
    return sum(float(r["value"][1]) for r in result)


@pytest.fixture(scope="module")
def prometheus_bin() -> Path:
    binary = prometheus_binary()
    if binary is None:
        pytest.skip(
            f"no prometheus binary at {PROMETHEUS} nor on PATH: run scripts/install-prometheus.sh "
            "(Debian's package, unpacked; .ci/run does)"
        )
    return binary


@pytest.fixture(scope="module")
async def observed(
    tmp_path_factory: pytest.TempPathFactory, prometheus_bin: Path
) -> AsyncIterator[tuple[DevProcess, Prometheus, list[devstack.MetricsTarget]]]:
    root = tmp_path_factory.mktemp("metrics")
    cfg = free_port_config(load_config(), f"127.0.0.1:{devstack.free_port()}")
    config_file = root / "dev-config.json"
    config_file.write_text(cfg.model_dump_json())
    worker = f"127.0.0.1:{devstack.free_port()}"
    temporal_metrics = devstack.free_port()
    data_dir = root / "data"
    dev = DevProcess(
        config_file,
        data_dir,
        "--worker-metrics",
        worker,
        "--temporal-metrics-port",
        str(temporal_metrics),
        user=USER,
    )
    targets = devstack.metrics_targets(cfg, worker, temporal_metrics)
    prom: Prometheus | None = None
    try:
        await dev.start()
        printed = "".join(dev.output)
        # iris dev prints every metrics address and where its Prometheus config is.
        lines = printed.splitlines()
        for target in targets:
            assert any(target.url in line and line.endswith(target.name) for line in lines), printed
        scrape_file = data_dir / "prometheus.yml"
        assert "prometheus config" in printed and str(scrape_file) in printed, printed
        # Its config, scraping every second here (its own interval is 5 s).
        scrape = yaml.safe_load(scrape_file.read_text())
        scrape["global"]["scrape_interval"] = "1s"
        fast = root / "prometheus.yml"
        fast.write_text(yaml.safe_dump(scrape))
        prom = Prometheus(prometheus_bin, fast, root)
        prom.start()
        yield dev, prom, targets
    finally:
        if prom is not None:
            prom.stop()
        code = await dev.stop()
        assert code == 0, "".join(dev.output)


@pytest.mark.timeout(900)
async def test_prometheus_scrapes_every_target_and_finds_each_iris_metric(
    observed: tuple[DevProcess, Prometheus, list[devstack.MetricsTarget]],
) -> None:
    dev, prom, targets = observed

    # ---- every target up -------------------------------------------------------------------
    async def all_up() -> list[dict[str, Any]] | None:
        try:
            active: list[dict[str, Any]] = (await prom.get("/api/v1/targets"))["activeTargets"]
        except httpx.HTTPError:
            return None  # not listening yet
        up = [t for t in active if t["health"] == "up"]
        return active if len(active) == len(targets) and len(up) == len(targets) else None

    active = await eventually(all_up, "every target up", timeout=90)
    assert sorted((t["labels"]["job"], t["labels"]["instance"]) for t in active) == sorted(
        (t.job, t.address) for t in targets
    )
    assert {t["labels"].get("cluster") for t in active if t["labels"]["job"] == devstack.CONTROLLER_JOB} == {
        "marin",
        "cw-us-east-02a",
        "cw-rno2a",
    }

    # ---- a queued job: iris_queued_jobs with its reason ------------------------------------------
    # 2 × 8 H100 on one backend, which only cw-us-east-02a's 16 hold, while a sleeper holds one of
    # them: it waits in the queue (until cancelled). A job larger than every backend would be
    # rejected at submit instead (docs/DESIGN.md, "Never fits").
    code, _, err = await dev.iris(
        "job", "run", "--no-wait", "--job-name", "hold", "--target-cluster", "cw-us-east-02a",
        "--device-type", "h100", "--gpu-count", "1", "--", "sleep", "3600",
    )  # fmt: skip
    assert code == 0, err

    async def holding() -> bool:
        code, out, _ = await dev.iris("job", "describe", "hold", "--json")
        return code == 0 and json.loads(out)["state"] == "RUNNING"

    await eventually(holding, "the sleeper holding one H100 of cw-us-east-02a", timeout=90)
    code, _, err = await dev.iris(
        "job", "run", "--no-wait", "--job-name", "big", "--device-type", "h100", "--gpu-count", "8",
        "--replicas", "2", "--", "true",
    )  # fmt: skip
    assert code == 0, err
    waiting_codes = {c.value for c in ReasonCode if c.waiting}
    queued_query = f'{metrics.QUEUED_JOBS}{{band="interactive",device_variant="h100"}} > 0'
    queued = await eventually(lambda: prom.query(queued_query), "the queued job in iris_queued_jobs")
    assert len(queued) == 1 and value(queued) == 1, queued
    reason = queued[0]["metric"]["reason"]
    assert reason in waiting_codes, queued
    code, out, err = await dev.iris("job", "describe", "big", "--json")
    assert code == 0, err
    assert json.loads(out)["reason_code"] == reason  # the code describe shows

    # ---- the queued job cancelled: its label set goes to 0 --------------------------------------
    code, _, err = await dev.iris("job", "cancel", "big")
    assert code == 0, err
    gone = f'{metrics.QUEUED_JOBS}{{band="interactive",device_variant="h100",reason="{reason}"}} == 0'
    await eventually(lambda: prom.query(gone), "the cancelled job's queued series at 0")
    code, _, err = await dev.iris("job", "cancel", "hold")
    assert code == 0, err

    # ---- a spilled job: handoff, queue wait, mirror lag, controller launch -------------------------
    code, out, err = await dev.iris(
        "job", "run", "--job-name", "spill", "--device-type", "h100", "--gpu-count", "8", "--", "true"
    )
    assert code == 0 and "SUCCEEDED" in err, err
    code, out, err = await dev.iris("job", "describe", "spill", "--json")
    assert code == 0, err
    peer = json.loads(out)["cluster"]
    assert peer in ("cw-us-east-02a", "cw-rno2a"), peer

    # ---- a rejected job, and one its pinned peer refuses ------------------------------------------
    code, _, err = await dev.iris("job", "run", "--device-type", "tpu-v9", "--", "true")
    assert code == 2 and "rejected" in err.lower(), err
    code, _, err = await dev.iris(
        "job", "run", "--job-name", "forced", "--target-cluster", "cw-rno2a", "--device-type", "tpu-v9",
        "--gpu-count", "4", "--", "true",
    )  # fmt: skip
    assert code != 0 and "refused" in err, err

    # ---- PromQL finds each iris_* metric with the right labels --------------------------------------
    expected: dict[str, str] = {
        # The worker (activities).
        f'{metrics.HANDOFFS}{{job="iris-worker",peer="{peer}",outcome="accepted"}}': "the spill's handoff",
        f'{metrics.HANDOFFS}{{peer="cw-rno2a",outcome="refused"}}': "the pinned job's refused handoff",
        f'{metrics.MIRROR_LAG}_count{{peer="{peer}"}}': "the spilled job's mirrored changes",
        f'{metrics.PLACEMENT_TICK}_count{{job="iris-worker"}}': "the ticks",
        f'{metrics.PEER_FREE_DEVICES}{{peer="cw-us-east-02a",backend="h100-us-east-02a",device="h100"}}': (
            "a GPU peer's free chips"
        ),
        f'{metrics.PEER_FREE_DEVICES}{{peer="marin",backend="cpu-us-central1-a",device="cpu"}}': (
            "the home's free CPU slots"
        ),
        # The worker (workflow code).
        f'{metrics.JOBS_SUBMITTED}{{band="interactive"}}': "the submissions",
        f'{metrics.QUEUE_WAIT}_count{{band="interactive"}}': "the spill's wait in the queue",
        # The controllers.
        f'{metrics.CONTROLLER_LAUNCHES}{{cluster="{peer}",backend=~"h100-.*",outcome="accepted"}}': (
            "the spill's launch on its peer"
        ),
        f'{metrics.CONTROLLER_REFUSALS}{{cluster="cw-rno2a",reason="unsupported_demand"}}': (
            "the pinned job's refusal"
        ),
        f'{metrics.CONTROLLER_REQUESTS}{{cluster="{peer}",method="POST",route="/v1/jobs",status="200"}}': (
            "the spill's launch request"
        ),
        f'{metrics.CONTROLLER_REQUESTS}{{cluster="cw-rno2a",route="/v1/changes",status="200"}}': (
            "the watcher's long polls"
        ),
        f'{metrics.CONTROLLER_FREE_SLOTS}{{cluster="cw-us-east-02a",device="h100"}}': "its free chips",
        # Temporal's SDK (on the worker's endpoint) and its server.
        'temporal_worker_task_slots_available{job="iris-worker",worker_type="ActivityWorker"}': "SDK slots",
        'temporal_request{job="iris-worker"}': "the SDK's calls to the server",
    }
    for promql, what in expected.items():
        found = await eventually(functools.partial(prom.query, f"{promql} > 0"), f"{what}: {promql}")
        assert value(found) > 0, (promql, found)
    for name in ("marin", "cw-us-east-02a", "cw-rno2a"):
        reachable = await prom.query(f'{metrics.PEER_REACHABLE}{{peer="{name}"}}')
        assert value(reachable) == 1, (name, reachable)
    for name in ("marin", "cw-us-east-02a", "cw-rno2a"):
        running = await prom.query(f'{metrics.CONTROLLER_RUNNING_JOBS}{{cluster="{name}"}}')
        assert running, name
    assert value(await prom.query('count({job="temporal"})')) > 100  # the dev server's own

    # ---- every metric the dashboard queries exists, and each of its queries runs ----------------
    names = set(await prom.get("/api/v1/label/__name__/values"))
    missing = sorted(dashboard_metric_names() - names)
    assert missing == [], missing
    for expr in expressions():
        await prom.query(expr)  # a PromQL error fails here (status "error", HTTP 400)
    print(json.dumps({"targets": [(t["labels"]["job"], t["scrapeUrl"]) for t in active]}))


# ---- `iris worker --metrics-address` ---------------------------------------------------------------


async def test_iris_worker_serves_the_sdk_and_iris_metrics_where_told(tmp_path: Path) -> None:
    """A deployment's worker (`iris worker`, as docker-compose runs it): the SDK's temporal_* and the
    tick's iris_* on the address given; an unusable address is one line, exit 2, nothing started."""
    iris = str(VENV_BIN / "iris")
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(devstack.venv_bin("temporal")),
        search_attributes=SEARCH_ATTRIBUTE_KEYS,
        dev_server_startup_timeout=timedelta(seconds=60),
    )
    try:
        # The demo topology on free ports: no controller answers, so every peer is unreachable.
        cfg = free_port_config(load_config(), env.client.service_client.config.target_host)
        config_file = tmp_path / "worker-config.json"
        config_file.write_text(cfg.model_dump_json())

        def worker_argv(data_dir: Path, address: str) -> list[str]:
            return [iris, "--config", str(config_file), "worker", "--data-dir", str(data_dir),
                    "--metrics-address", address]  # fmt: skip

        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            taken = f"127.0.0.1:{busy.getsockname()[1]}"
            for address, said in (("nope", "invalid"), (taken, "in use")):
                proc = await asyncio.create_subprocess_exec(
                    *worker_argv(tmp_path / "bad", address), stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                )  # fmt: skip
                _, raw = await asyncio.wait_for(proc.communicate(), 60)
                err = raw.decode()
                assert proc.returncode == 2, err
                assert err.startswith(f"error: metrics address {address}: ") and said in err.lower(), err
                assert err.count("\n") == 1, err
                assert not (tmp_path / "bad").exists()  # nothing started
        port = devstack.free_port()
        worker = devstack.ManagedProcess(
            name="iris worker",
            argv=worker_argv(tmp_path / "data", f"127.0.0.1:{port}"),
            log_path=tmp_path / "worker.log",
            ready=lambda: devstack.http_ok(f"http://127.0.0.1:{port}/metrics"),
            address=f"127.0.0.1:{port}",
        )
        worker.start()
        try:
            await asyncio.to_thread(worker.wait_ready, 60)

            async def exported() -> str | None:
                async with httpx.AsyncClient(timeout=5) as http:
                    text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
                ticked = f"{metrics.PLACEMENT_TICK}_count" in text
                unreachable = f"{metrics.PEER_REACHABLE}{{" in text and 'peer="cw-rno2a"' in text
                return (
                    text
                    if ticked and unreachable and "temporal_worker_task_slots_available" in text
                    else None
                )

            text = await eventually(exported, "the worker's tick and slot metrics", timeout=60)
            reachable = [line for line in text.splitlines() if line.startswith(metrics.PEER_REACHABLE + "{")]
            assert reachable and all(line.endswith(" 0") for line in reachable), reachable
        finally:
            worker.stop()
    finally:
        await env.shutdown()
