"""One trace from submit to the peer's launch handler (issue 18, acceptance 2; docs/DESIGN.md,
"Tracing").

A real Temporal dev server; the three controllers of the demo topology, each a real uvicorn server
(in threads of this process, so that their spans reach the same tracer provider); the worker and
the SDK client connected through ``iris.temporal.connect``, as in production. Tracing is installed
with an in-memory exporter before anything is built. A GPU job spills to a peer (home has no
GPUs), and the spans of its trace must chain, parent by parent, from the client's
``StartWorkflow:JobWorkflow`` down to the peer controller's ``POST /v1/jobs`` handler.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import uvicorn
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from otlp_collector import running_collector
from signing import SignerAuth
from stack import CONFIGS, VENV_BIN, free_port_config, wait_until
from temporalio.api.common.v1 import Header, Payload, Payloads, WorkflowExecution
from temporalio.api.workflowservice.v1 import SignalWorkflowExecutionRequest
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from iris import contract, devstack, tracing
from iris.client import AsyncIrisClient, current_user
from iris.config import FederationConfig, load_config, store_url
from iris.contract import SEARCH_ATTRIBUTE_KEYS, job_workflow_id
from iris.controller.app import create_app
from iris.controller.identity import KEY_DIR_ENV, TokenSigner
from iris.jobs import JobState
from iris.keydirs import provision_key_dirs
from iris.objectstore import open_store
from iris.store import FederationStore
from iris.temporal import connect, data_converter
from iris.userauth import USER_KEY_DIR_ENV, register_user
from worker.main import build_worker, ensure_manager

VALID_PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class ThreadedServer:
    """A controller app served by uvicorn in a thread of this process (its own event loop)."""

    def __init__(self, app: object, port: int) -> None:
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False)  # type: ignore[arg-type]
        )
        self.thread = threading.Thread(target=self.server.run, name=f"controller-{port}", daemon=True)

    async def start(self) -> None:
        self.thread.start()

        async def started() -> bool:
            if not self.thread.is_alive():
                raise RuntimeError("a controller did not start")
            return self.server.started

        await wait_until(started, timeout=30, interval=0.05, what="a controller to start")

    async def stop(self) -> None:
        self.server.should_exit = True
        await asyncio.to_thread(self.thread.join, 30)


@dataclass
class Traced:
    config: FederationConfig
    client: Client
    iris: AsyncIrisClient
    spans: InMemorySpanExporter
    key_dir: Path
    config_file: Path


@pytest.fixture(scope="module")
async def traced(tmp_path_factory: pytest.TempPathFactory, stack_keys: Path) -> AsyncIterator[Traced]:
    exporter = InMemorySpanExporter()
    tracing.install(tracing.provider_for("iris-test", exporter, batch=False))
    root = tmp_path_factory.mktemp("tracing")
    servers: list[ThreadedServer] = []
    services: list[devstack.ManagedProcess] = []
    env: WorkflowEnvironment | None = None
    store: FederationStore | None = None
    try:
        env = await WorkflowEnvironment.start_local(
            dev_server_existing_path=str(devstack.venv_bin("temporal")),
            search_attributes=SEARCH_ATTRIBUTE_KEYS,
            data_converter=data_converter(),
            dev_server_startup_timeout=timedelta(seconds=60),
        )
        cfg = free_port_config(load_config(CONFIGS["process"]), env.client.service_client.config.target_host)
        cfg.temporal.task_queue = "iris-tracing"
        # The key layout of tests/stack.py (one per test process: a stack of the session may run
        # in this process too and reads the same variables).
        os.environ.setdefault(USER_KEY_DIR_ENV, str(stack_keys.with_name(stack_keys.name + "-users")))
        register_user(cfg, current_user(), ["admin"])
        config_file = root / "clusters.json"
        config_file.write_text(cfg.model_dump_json(indent=2))
        key_dirs = provision_key_dirs(cfg, stack_keys)
        os.environ[KEY_DIR_ENV] = str(key_dirs.of(cfg.home))
        # The home's object store, where the worker relays the job's log (the peers' S3 is not
        # needed: the job reads no artifact).
        gcs = devstack.gcs_server(cfg, root)
        gcs.start()
        services.append(gcs)
        await asyncio.to_thread(gcs.wait_ready, 60)
        home_store = cfg.home_cluster.object_store
        assert home_store is not None
        os.environ.update(devstack.store_credentials(cfg, cfg.home))
        await asyncio.to_thread(
            open_store(home_store, environ=devstack.store_credentials(cfg, cfg.home)).ensure_bucket
        )
        for c in cfg.clusters:
            app = create_app(cfg, c.name, root / "clusters" / c.name, key_dir=key_dirs.of(c.name))
            server = ThreadedServer(app, c.port)
            servers.append(server)
            await server.start()
        store = FederationStore(store_url(cfg, root))
        client = await connect(cfg)  # the production path: the tracing interceptor comes from here
        async with build_worker(client, cfg, store):
            await ensure_manager(client, cfg)
            yield Traced(
                cfg, client, AsyncIrisClient(client, cfg), exporter, key_dirs.of(cfg.home), config_file
            )
    finally:
        for server in servers:
            await server.stop()
        for service in services:
            await asyncio.to_thread(service.stop)
        if store is not None:
            store.close()
        if env is not None:
            await env.shutdown()
        tracing.uninstall()


def chain(span: ReadableSpan, by_id: dict[int, ReadableSpan]) -> list[ReadableSpan]:
    """``span`` and its ancestors, nearest first, as far as they are in ``by_id``."""
    out = [span]
    while out[-1].parent is not None and out[-1].parent.span_id in by_id:
        out.append(by_id[out[-1].parent.span_id])
    return out


def is_launch_handler(span: ReadableSpan) -> bool:
    attrs = span.attributes or {}
    method = attrs.get("http.request.method", attrs.get("http.method"))
    return span.kind is SpanKind.SERVER and attrs.get("http.route") == "/v1/jobs" and method == "POST"


async def test_one_trace_from_submit_to_the_peers_launch_handler(traced: Traced) -> None:
    job_id = await traced.iris.submit(
        ["python", "-c", "print('traced')"], workdir=None, name="traced-gpu", device_type="h100", gpu_count=1
    )

    def root_span() -> ReadableSpan | None:
        roots = [
            s
            for s in traced.spans.get_finished_spans()
            if s.name == "StartWorkflow:JobWorkflow"
            and (s.attributes or {}).get("temporalWorkflowID") == job_workflow_id(job_id)
        ]
        assert len(roots) <= 1
        return roots[0] if roots else None

    def launch_spans() -> list[ReadableSpan]:
        root = root_span()
        if root is None:
            return []
        return [
            s
            for s in traced.spans.get_finished_spans()
            if s.context.trace_id == root.context.trace_id and is_launch_handler(s)
        ]

    async def launched() -> bool:
        return bool(launch_spans())

    await wait_until(launched, timeout=90, what="the peer's launch handler span in the job's trace")
    status = await traced.iris.describe(job_id)
    assert status.cluster is not None and status.cluster != traced.config.home, status

    root = root_span()
    assert root is not None
    assert root.parent is None, "the trace starts at the client's submit"
    assert root.kind is SpanKind.CLIENT
    trace_spans = [
        s for s in traced.spans.get_finished_spans() if s.context.trace_id == root.context.trace_id
    ]
    by_id = {s.context.span_id: s for s in trace_spans}
    (launch,) = launch_spans()
    path = chain(launch, by_id)
    names = [s.name for s in reversed(path)]
    print("trace", format(root.context.trace_id, "032x"), ":", " -> ".join(names))
    print("spans in the trace:", sorted({s.name for s in trace_spans}))
    # Unbroken from the submit to the handler: the client's start, the workflow's launch
    # activity, its HTTP request, the peer's handler.
    assert path[-1] is root, names
    assert "RunActivity:launch_job" in names, names
    assert names.index("StartActivity:launch_job") < names.index("RunActivity:launch_job"), names
    peer = traced.config.cluster(status.cluster)
    http_client = path[1]
    assert http_client.kind is SpanKind.CLIENT and http_client.name == "POST", names
    assert (http_client.attributes or {}).get("http.url") == f"{peer.url}/v1/jobs"
    assert (launch.attributes or {}).get("net.host.port") == peer.port
    # The workflow ran in the same trace too, and the job, traced, ran to its end.
    assert any(s.name == "RunWorkflow:JobWorkflow" for s in trace_spans)

    async def succeeded() -> bool:
        return (await traced.iris.describe(job_id)).state is JobState.SUCCEEDED

    await wait_until(succeeded, timeout=60, what=f"{job_id} SUCCEEDED")

    # The placement manager and the watchers run untraced (their traces would never end): nothing
    # of theirs is recorded, down to the controllers' side of the watchers' long polls.
    background = [
        s.name
        for s in traced.spans.get_finished_spans()
        if "PlacementManager" in s.name
        or "PeerWatch" in s.name
        or s.name in ("RunActivity:placement_tick", "RunActivity:watch_peer")
        or (s.attributes or {}).get("http.route") == "/v1/changes"
    ]
    assert background == []


async def test_hostile_trace_headers_do_not_break_a_live_controller(traced: Traced) -> None:
    """The unit tests (tests/tracing) cover the propagator; here a real uvicorn server: a signed
    request with a malformed ``traceparent`` and ~12 KiB of ``tracestate`` and baggage (under the
    server's 16 KiB header limit) is answered as usual, as a fresh trace."""
    peer = "cw-rno2a"
    signer = TokenSigner.from_config(traced.config, traced.config.home, traced.key_dir)
    headers = {
        "traceparent": "00-" + "f" * 32 + "-zz-01",
        "tracestate": ",".join(f"k{i}=v{i}" for i in range(1000))[:6000],
        "baggage": "token=" + "x" * 6000,
    }
    before = {s.context.span_id for s in traced.spans.get_finished_spans()}
    async with httpx.AsyncClient(
        base_url=traced.config.cluster(peer).url, auth=SignerAuth(signer, peer), timeout=10
    ) as http:
        plain = await http.get("/v1/backends")
        hostile = await http.get("/v1/backends", headers=headers)
    assert plain.status_code == hostile.status_code == 200, hostile.text
    assert hostile.json() == plain.json()

    async def both_recorded() -> bool:
        return len(new_server_spans()) == 2

    def new_server_spans() -> list[ReadableSpan]:
        return [
            s
            for s in traced.spans.get_finished_spans()
            if s.context.span_id not in before
            and s.kind is SpanKind.SERVER
            and (s.attributes or {}).get("http.route") == "/v1/backends"
        ]

    await wait_until(both_recorded, timeout=10, what="the two server spans")
    for span in new_server_spans():
        assert span.parent is None  # neither request carried a usable parent
        assert span.context.trace_id != int("f" * 32, 16)
        assert not span.context.trace_state


async def test_the_cli_sends_its_spans_before_it_exits(traced: Traced) -> None:
    """A real ``iris`` process with ``OTEL_EXPORTER_OTLP_ENDPOINT``: its client span (a cancel's
    update) reaches the collector, named ``iris-client`` (the CLI ends with ``os._exit``, past the
    exporter's atexit hook, so cli/app.py sends what is pending first)."""
    with running_collector() as collector:
        env = {
            **os.environ,
            "IRIS_CONFIG": str(traced.config_file),
            "IRIS_USER": current_user(),
            tracing.ENDPOINT_ENV: collector.url,
        }
        proc = await asyncio.create_subprocess_exec(
            str(VENV_BIN / "iris"),
            "job",
            "cancel",
            f"{current_user()}/no-such-job",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        _, err = await asyncio.wait_for(proc.communicate(), 60)
        # An update that ran, and failed (describe would send no traced call: it asks the server
        # how the run stands first, docs/DESIGN.md "Reading a job's status").
        assert proc.returncode != 0 and "not found" in err.decode(), err.decode()
        assert (
            "/v1/traces",
            "iris-client",
            f"StartWorkflowUpdate:{contract.CANCEL_JOB}",
        ) in collector.spans()


HOSTILE_TRACER_DATA: dict[str, Payload] = {
    "not JSON": Payload(metadata={"encoding": b"json/plain"}, data=b"{not json"),
    "a list": Payload(metadata={"encoding": b"json/plain"}, data=b"[1, 2, 3]"),
    "numbers": Payload(metadata={"encoding": b"json/plain"}, data=b'{"traceparent": 7, "baggage": null}'),
    "unknown encoding": Payload(metadata={"encoding": b"binary/nonsense"}, data=b"\x00\x01"),
    "1 MiB": Payload(
        metadata={"encoding": b"json/plain"},
        data=json.dumps({"traceparent": VALID_PARENT, "baggage": "x" * (1 << 20)}).encode(),
    ),
}


async def test_a_hostile_tracing_header_on_a_signal_does_not_stall_the_job(traced: Traced) -> None:
    """Anyone who may signal a job can set the header Temporal's tracing interceptor reads
    (``_tracer-data``). A signal carrying a malformed one must not fail the job's workflow task:
    the job goes on and ends as it would."""
    job_id = await traced.iris.submit(["sleep", "3"], workdir=None, name="traced-signals")

    async def running() -> bool:
        return (await traced.iris.describe(job_id)).state is JobState.RUNNING

    await wait_until(running, timeout=60, what=f"{job_id} RUNNING")
    for attack, payload in HOSTILE_TRACER_DATA.items():
        await traced.client.workflow_service.signal_workflow_execution(
            SignalWorkflowExecutionRequest(
                namespace=traced.client.namespace,
                workflow_execution=WorkflowExecution(workflow_id=job_workflow_id(job_id)),
                signal_name=contract.WANT_LOGS,
                input=Payloads(payloads=[Payload(metadata={"encoding": b"json/plain"}, data=b"0")]),
                identity=f"hostile ({attack})",
                header=Header(fields={"_tracer-data": payload}),
            )
        )

    async def succeeded() -> bool:
        return (await traced.iris.describe(job_id)).state is JobState.SUCCEEDED

    await wait_until(succeeded, timeout=60, what=f"{job_id} SUCCEEDED after the hostile signals")
    failed_tasks = [
        e
        async for e in traced.client.get_workflow_handle(job_workflow_id(job_id)).fetch_history_events()
        if e.HasField("workflow_task_failed_event_attributes")
    ]
    assert failed_tasks == []
