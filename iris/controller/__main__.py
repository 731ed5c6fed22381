"""Run one cluster controller: ``python -m iris.controller --config FILE --cluster NAME --state-dir DIR``.

A bad config, an unknown cluster or unusable keys print one line on stderr and exit with code 2
before anything is started; so does a cluster without ``[clusters.auth]`` asked to bind a
non-loopback address (docs/DESIGN.md, "Handoff and admission"), and an unusable
``IRIS_RETENTION_SWEEP_S`` (seconds between retention sweeps, default 300; docs/DESIGN.md,
"Retention").
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import sys
from pathlib import Path
from types import FrameType

from iris.config import ConfigError, load_config

EXIT_BAD_CONFIG = 2


def is_loopback(host: str) -> bool:
    """Whether ``host`` binds loopback only: ``localhost`` or a loopback IP literal. Anything else
    (``0.0.0.0``, ``::``, a name that could resolve elsewhere) counts as reachable from outside."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m iris.controller",
        description="Run an Iris cluster controller.",
        epilog="Finished jobs are removed after the cluster's retention_s; $IRIS_RETENTION_SWEEP_S "
        "sets the seconds between sweeps (default 300).",
    )
    p.add_argument("--config", required=True, help="federation config file (TOML or JSON)")
    p.add_argument("--cluster", required=True, help="name of the cluster this controller serves")
    p.add_argument("--state-dir", required=True, type=Path, help="directory for the job database and logs")
    p.add_argument("--port", type=int, help="listen port (default: the cluster's configured port)")
    p.add_argument(
        "--host",
        help="listen address (default: the cluster's configured host); a cluster without "
        "[clusters.auth] may only bind a loopback address",
    )
    p.add_argument(
        "--key-dir",
        type=Path,
        help="base directory of relative key paths in the auth config (default: $IRIS_KEY_DIR, "
        "else the state dir's parent)",
    )
    p.add_argument(
        "--kill-grace",
        type=float,
        default=5.0,
        help="seconds between SIGTERM and SIGKILL when a job is terminated",
    )
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # Everything the controller writes (store, logs, bundles, job dirs) is its own user's alone
    # (docs/DESIGN.md, "Job → controller").
    os.umask(0o077)
    # Imports after logging setup; uvicorn and the app are only needed once the config is good.
    import uvicorn

    from iris.controller.app import create_app
    from iris.controller.bundles import private_mounts
    from iris.controller.identity import default_key_dir
    from iris.controller.privileges import harden_key_file, privilege_warning, resolve_run_as
    from iris.controller.retention import sweep_interval_s
    from iris.controller.sandbox import Sandbox

    try:
        config = load_config(args.config)
        try:
            cluster = config.cluster(args.cluster)
        except KeyError:
            known = ", ".join(config.cluster_names)
            raise ConfigError(
                f"unknown cluster {args.cluster!r} (clusters in {args.config}: {known})"
            ) from None
        port = args.port if args.port is not None else cluster.port
        if not 0 <= port <= 65535:
            raise ConfigError(f"invalid port {port}")
        if args.kill_grace < 0:
            raise ConfigError("--kill-grace must be >= 0")
        sweep_interval_s()
        host = args.host or cluster.host
        if cluster.auth is None and not is_loopback(host):
            raise ConfigError(
                f"cluster {cluster.name} has no [clusters.auth] section: refusing to serve "
                f"unauthenticated on non-loopback address {host!r} (configure auth, or bind 127.0.0.1)"
            )
        key_dir = args.key_dir or default_key_dir(args.state_dir.resolve().parent)
        run_as = resolve_run_as(cluster)
        processes = any(b.kind == "process" for b in cluster.backends)
        if processes:
            # Before any thread starts: the jobs' workspace overlays live in a mount namespace of
            # the controller's own, and die with it (docs/DESIGN.md, "Workspace bundles").
            private_mounts()
        # Decided once here (the backends take the same answer); "required" without it is exit 2.
        sandbox = Sandbox.for_cluster(cluster, args.state_dir, key_dir) if processes else None
        app = create_app(config, cluster.name, args.state_dir, key_dir=key_dir, kill_grace_s=args.kill_grace)
    except ConfigError as exc:
        print(f"iris controller: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    if cluster.auth is not None and cluster.auth.private_key_file:
        private_key = Path(cluster.auth.private_key_file).expanduser()
        harden_key_file(private_key if private_key.is_absolute() else key_dir / private_key)
    # Said once, at start: what the jobs' isolation lacks on this host (docs/SECURITY.md, "The job
    # sandbox"). run_as applies only to jobs outside the sandbox.
    if sandbox is not None:
        line = sandbox.startup_line()
        if line is not None:
            logging.getLogger("iris.controller").warning(line)
        warning = None if sandbox.enabled else privilege_warning(run_as)
        if warning is not None:
            logging.getLogger("iris.controller").warning(warning)

    try:
        args.state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"iris controller: cannot create state dir {args.state_dir}: {exc.strerror}", file=sys.stderr)
        return EXIT_BAD_CONFIG

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # Long polls of the change feed answer at once: a graceful stop does not wait for them.
            executor = getattr(app.state, "executor", None)
            if executor is not None:
                asyncio.get_event_loop().call_soon_threadsafe(executor.feed.close)
            super().handle_exit(sig, frame)

    server = Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_config=None,  # keep our logging setup; one line per request comes from the app
            access_log=False,
            timeout_graceful_shutdown=15,
        )
    )
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
