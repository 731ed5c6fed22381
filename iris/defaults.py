"""Plain values the CLI's help shows (defaults and limits), in a module that imports only the
standard library: building `iris --help` loads no pydantic model, Temporal SDK or store
(tests/test_cli_imports.py). Their owners re-export them: iris.config (the paths), iris.jobs (the
job limits) and iris.devstack (the metrics addresses)."""

from __future__ import annotations

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
# Where `iris dev` and a standalone `iris worker` keep state unless told otherwise.
DEFAULT_DATA_DIR = PROJECT_ROOT / ".data" / "dev"

# A job's retry budgets (each of max_retries_failure, max_retries_preemption) and run timeout.
MAX_RETRIES = 100
MAX_TIMEOUT_S = 365 * 24 * 3600.0

# Where `iris dev` serves the worker's metrics and has Temporal serve its own, unless told otherwise.
DEFAULT_WORKER_METRICS = "127.0.0.1:9464"
DEFAULT_TEMPORAL_METRICS_PORT = 9465
