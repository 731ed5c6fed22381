"""`iris dev`: the whole embedded stack from one command, stopped by Ctrl-C."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated

import typer

from cli import common
from iris.defaults import (
    DEFAULT_DATA_DIR,
    DEFAULT_TEMPORAL_METRICS_PORT,
    DEFAULT_WORKER_METRICS,
    PROJECT_ROOT,
)

if TYPE_CHECKING:
    import asyncio

    from iris import devstack
    from iris.config import FederationConfig
    from iris.reports import FederationView

# The demo topology with the GPU peers on a local Ray head (`iris dev --ray`).
RAY_CONFIG = PROJECT_ROOT / "config" / "clusters-ray.toml"
# ... and on a local single-node Slurm (`iris dev --backend slurm`; iris/slurmdev.py).
SLURM_CONFIG = PROJECT_ROOT / "config" / "clusters-slurm.toml"
BACKENDS = ("process", "ray", "slurm")


def _ports(cfg: FederationConfig) -> list[tuple[str, str, int]]:
    host, _, port = cfg.temporal.address.rpartition(":")
    ports = [
        ("Temporal", host or "127.0.0.1", int(port)),
        ("Temporal Web UI", host or "127.0.0.1", cfg.temporal.ui_port),
        ("S3 (moto)", "127.0.0.1", cfg.s3_port),
        ("GCS (fake-gcs-server)", "127.0.0.1", cfg.gcs_port),
    ]
    ports += [(f"controller {c.name}", c.host, c.port) for c in cfg.clusters]
    return ports


async def _serve(cfg: FederationConfig, data_dir: Path, metrics: list[devstack.MetricsTarget]) -> None:
    import asyncio

    from iris import devstack, tracing
    from iris.config import store_url
    from iris.store import FederationStore
    from iris.temporal import connect, payload_encryption
    from worker.main import build_worker, ensure_manager

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    _STOP.wake = functools.partial(loop.call_soon_threadsafe, stop.set)
    if _STOP.requested:
        return
    # This process hosts the worker, and serves its metrics.
    worker = next(t.address for t in metrics if t.job == devstack.WORKER_JOB)
    client = await connect(cfg, metrics=worker, service=tracing.WORKER_SERVICE)
    url = store_url(cfg, data_dir)
    store = FederationStore(url)
    try:
        async with build_worker(client, cfg, store):
            await ensure_manager(client, cfg)
            typer.echo(f"{'federation store':<28} {url}")
            tick = f"placement tick every {cfg.tick_interval_s}s"
            typer.echo(f"{'worker':<28} task queue {cfg.temporal.task_queue}, {tick}")
            typer.echo(f"{'':<28} {payload_encryption(client) or 'payloads NOT encrypted'}")
            # Every metrics endpoint, and a Prometheus config scraping them (docs/DESIGN.md, "Metrics").
            for i, target in enumerate(metrics):
                typer.echo(f"{'metrics (Prometheus)' if i == 0 else '':<28} {target.url:<32} {target.name}")
            scrape = data_dir / "prometheus.yml"
            scrape.write_text(devstack.prometheus_config(metrics))
            typer.echo(f"{'prometheus config':<28} {scrape} (scrapes every endpoint above)")
            if not await _await_capacity(cfg, stop):
                return
            typer.echo("\nReady. Try:  uv run iris job run -- echo hello      (Ctrl-C stops everything)")
            await stop.wait()
            typer.echo("\nstopping…")
    finally:
        _STOP.wake = None
        store.close()


# `iris dev` says Ready. once every cluster has reported its capacity (a Ray peer's comes when its
# Ray head has registered its resources); until then, every CAPACITY_NOTE_S, what it waits for.
CAPACITY_POLL_S = 0.5
CAPACITY_NOTE_S = 10.0


def capacity_missing(view: FederationView) -> list[str]:
    """Each cluster or backend of ``view`` that has not reported its capacity, and why."""
    missing = []
    for r in view.reports:
        if not r.reachable:
            missing.append(f"{r.peer_id} (not answering: {r.error or 'no reply'})")
            continue
        if not r.backends:
            missing.append(f"{r.peer_id} (no backends reported)")
        for b in r.backends:
            if b.availability is None or not b.availability.total_amounts:
                missing.append(f"{r.peer_id}/{b.backend_id} (no capacity reported yet)")
    return missing


async def _await_capacity(cfg: FederationConfig, stop: asyncio.Event) -> bool:
    """Wait until every cluster has reported capacity, saying what is missing every
    CAPACITY_NOTE_S; False if a stop was asked for meanwhile."""
    import asyncio
    import time

    from iris.reports import gather_reports

    noted: float | None = None
    while not stop.is_set():
        missing = capacity_missing(await gather_reports(cfg))
        if not missing:
            return True
        if noted is None or time.monotonic() - noted >= CAPACITY_NOTE_S:
            typer.echo(f"{'waiting for capacity':<28} {'; '.join(missing)}")
            noted = time.monotonic()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), CAPACITY_POLL_S)
    return False


class _Stopper:
    """Ctrl-C and SIGTERM: the first one stops the stack, any later one only says it is stopping. A
    second Ctrl-C, or a SIGINT to the whole process group (which reaches `uv run` and this process,
    so twice), must not cut the teardown short and leave services running."""

    def __init__(self) -> None:
        self.requested = False
        # While the worker's event loop runs: how to wake it (else the signal interrupts the start).
        self.wake: Callable[[], object] | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            os.write(2, b"still stopping: every service started is being stopped\n")
            return
        self.requested = True
        if self.wake is not None:
            self.wake()
        else:
            raise KeyboardInterrupt

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self)


_STOP = _Stopper()


def dev_command(
    data_dir: Annotated[
        Path, typer.Option("--data-dir", help="Where the stack keeps its state (jobs survive restarts).")
    ] = DEFAULT_DATA_DIR,
    ray: Annotated[
        bool,
        typer.Option(
            "--ray",
            help="Run the Ray backends of the config (default config: config/clusters-ray.toml, the "
            "GPU peers on Ray) on a local Ray head started and stopped with the stack.",
        ),
    ] = False,
    backend: Annotated[
        str,
        typer.Option(
            "--backend",
            help="Where the GPU peers run their jobs: process, ray (as --ray), or slurm: a single-node "
            "Slurm (munged, slurmctld, slurmd) under DATA_DIR/slurm, started and stopped with the "
            "stack (default config: config/clusters-slurm.toml).",
        ),
    ] = "process",
    worker_metrics: Annotated[
        str,
        typer.Option(
            "--worker-metrics",
            metavar="HOST:PORT",
            help="Where the worker serves its Prometheus metrics (the SDK's temporal_* and Iris's "
            "iris_*) at /metrics. Every controller serves its own at /metrics on its port.",
        ),
    ] = DEFAULT_WORKER_METRICS,
    temporal_metrics_port: Annotated[
        int,
        typer.Option(
            "--temporal-metrics-port",
            min=1,
            max=65535,
            help="The port of the Temporal dev server's own Prometheus metrics (on its address).",
        ),
    ] = DEFAULT_TEMPORAL_METRICS_PORT,
) -> None:
    """Start the embedded stack: Temporal + UI, S3 and GCS emulators, every controller, the worker.

    Prints every address, the metrics endpoints among them, and writes DATA_DIR/prometheus.yml, a
    Prometheus config scraping the worker, every controller and Temporal."""
    import asyncio

    from iris import devstack
    from iris.client import current_user
    from iris.config import CONFIG_ENV, ConfigError, config_path
    from iris.controller.identity import KEY_DIR_ENV
    from iris.keydirs import ensure_payload_keys, provision_key_dirs
    from iris.payloadcodec import KEYRING_NAME, PAYLOAD_KEYS_ENV, install_keyring, read_keyring
    from iris.userauth import register_user, user_key_dir

    if backend not in BACKENDS:
        common.fail(f"--backend: {backend!r} is not one of {', '.join(BACKENDS)}", common.EXIT_INVALID)
    ray = ray or backend == "ray"
    if ray and common.STATE.config_file is None and not os.environ.get(CONFIG_ENV):
        common.STATE.config_file = RAY_CONFIG
    if backend == "slurm" and common.STATE.config_file is None and not os.environ.get(CONFIG_ENV):
        common.STATE.config_file = SLURM_CONFIG
    cfg = common.config()
    cfg_file = config_path(common.STATE.config_file).resolve()
    missing = devstack.missing_emulators()
    if missing:
        common.fail(
            f"iris dev needs the development dependencies ({', '.join(missing)}): run `uv sync`",
            common.EXIT_UNAVAILABLE,
        )
    try:
        ray_specs = devstack.ray_heads_for(cfg) if ray else []
    except devstack.ServiceError as exc:
        common.fail(str(exc), common.EXIT_INVALID)
    if ray and not ray_specs:
        common.fail(f'--ray: {cfg_file} has no backend with kind = "ray"', common.EXIT_INVALID)
    slurm_spec = None
    if backend == "slurm":
        from iris import slurmdev

        slurm_spec = slurmdev.spec_for(cfg)
        if slurm_spec is None:
            common.fail(
                f'--backend slurm: {cfg_file} has no backend with kind = "slurm"', common.EXIT_INVALID
            )
        why = slurmdev.unavailable()
        if why is not None:
            common.fail(f"--backend slurm: {why}", common.EXIT_UNAVAILABLE)
    try:
        metrics_host, metrics_port = devstack.host_port(worker_metrics)
    except ValueError as exc:
        common.fail(f"--worker-metrics: {exc}", common.EXIT_INVALID)
    metrics = devstack.metrics_targets(cfg, worker_metrics.strip(), temporal_metrics_port)
    ports = _ports(cfg)
    temporal_host = cfg.temporal.address.rpartition(":")[0] or "127.0.0.1"
    ports += [
        ("worker metrics", metrics_host, metrics_port),
        ("Temporal metrics", temporal_host, temporal_metrics_port),
    ]
    for spec in ray_specs:
        ports += [("Ray Jobs API", "127.0.0.1", spec.dashboard_port), ("Ray GCS", "127.0.0.1", spec.gcs_port)]
    busy = [(name, h, p) for name, h, p in ports if devstack.port_open(h, p)]
    if busy:
        owners = devstack.port_owners([p for _, _, p in busy])
        named = []
        for name, h, p in busy:
            who = ", ".join(f"pid {pid} ({cmd})" for pid, cmd in owners.get(p, []))
            named.append(f"{name} ({h}:{p}{' by ' + who if who else ''})")
        common.fail(
            f"port already in use: {'; '.join(named)} — is another `iris dev` running, or one left over?",
            common.EXIT_UNAVAILABLE,
        )
    _STOP.install()
    # Everything the stack writes (databases, logs, keys, emulators' files) is this user's alone:
    # new files 0600 and directories 0700, in every service started from here; and the data
    # directory 0700, with what an older version left readable tightened (docs/SECURITY.md,
    # "Payload encryption").
    os.umask(0o077)
    data_dir = data_dir.resolve()
    devstack.harden_data_dir(data_dir)
    # This process hosts the worker: the home cluster's credentials only (each controller gets its own).
    os.environ.update(devstack.store_credentials(cfg, cfg.home))
    # Each cluster's signing key pair, created on first start in that cluster's own directory
    # (docs/DESIGN.md, "Where secrets live"): this process (the home worker) reads the home one,
    # each controller its own; the others hold only public keys.
    key_dirs = provision_key_dirs(cfg, data_dir / "keys")
    created, key_dir = key_dirs.created, key_dirs.of(cfg.home)
    os.environ[KEY_DIR_ENV] = str(key_dir)
    # The payload key ring (docs/SECURITY.md, "Payload encryption"): this process's worker reads
    # it; the user's CLI gets a copy in its own ring, beside the user key; no controller gets it.
    try:
        payload_keys, payload_created = ensure_payload_keys(cfg, data_dir / "keys")
        own_ring = user_key_dir() / KEYRING_NAME
        install_keyring(own_ring, read_keyring(payload_keys))
    except ConfigError as exc:
        common.fail(str(exc), common.EXIT_INVALID)
    os.environ[PAYLOAD_KEYS_ENV] = str(payload_keys)
    # The user's signing key, created on first start and registered (admin) in this stack's config,
    # so `iris job run` works at once with verification on (docs/DESIGN.md, "User → home").
    user_key, _, user_key_created = register_user(cfg, current_user(), ["admin"])
    # Ray heads start first: they take longest to come up. A Slurm too: the controllers' Slurm
    # backends read the config it writes (their slurm.conf, their jobs' directory).
    heads = [devstack.ray_head(spec, data_dir, name="Ray head") for spec in ray_specs]
    slurms = []
    if slurm_spec is not None:
        slurm, cfg_file = slurmdev.for_dev(slurm_spec, cfg, data_dir)
        slurms.append(slurm)
    services: list[devstack.ManagedProcess | slurmdev.SlurmCluster] = [
        *heads,
        *slurms,
        devstack.temporal_server(
            cfg, data_dir, db_file=data_dir / "temporal.db", metrics_port=temporal_metrics_port
        ),
        devstack.s3_server(cfg, data_dir),
        devstack.gcs_server(cfg, data_dir),
        *(
            devstack.controller(cfg_file, cfg, c.name, data_dir, key_dir=key_dirs.of(c.name))
            for c in cfg.clusters
        ),
    ]
    started: list[devstack.ManagedProcess | slurmdev.SlurmCluster] = []
    code = common.EXIT_OK
    try:
        typer.echo(f"data directory: {data_dir}")
        made = "created" if user_key_created else "using"
        typer.echo(f"{made} the user key of {current_user()} (admin): {user_key}")
        if created:
            typer.echo(f"generated cluster keys for {', '.join(created)} in {key_dirs.root}/<cluster>")
        made = "created" if payload_created else "using"
        typer.echo(f"{made} the payload key ring {payload_keys} (your CLI's copy: {own_ring})")
        for svc in services:
            started.append(svc)  # first: a signal between the two must still stop it
            svc.start()
        for svc in services:
            svc.wait_ready(timeout=90)
            typer.echo(f"{svc.name:<28} {svc.address}")
        devstack.ensure_buckets(cfg)
        typer.echo(f"{'logs':<28} {data_dir / 'logs'}")
        asyncio.run(_serve(cfg, data_dir, metrics))
    except (devstack.ServiceError, ConfigError) as exc:  # e.g. the worker's metrics port taken meanwhile
        typer.secho(f"error: {exc}", err=True, fg=typer.colors.RED)
        code = common.EXIT_UNAVAILABLE
    except KeyboardInterrupt:
        typer.echo("\nstopping…")
    finally:
        _STOP.requested = True  # from here on, signals only say that the stack is stopping
        for svc in reversed(started):
            if isinstance(svc, devstack.ManagedProcess) and any(svc is head for head in heads):
                devstack.stop_ray_head(svc)
            else:
                svc.stop()
        typer.echo("stopped.")
    raise typer.Exit(code)
