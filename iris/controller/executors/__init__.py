"""Execution backends of a cluster controller: the shared executor and one engine per backend kind.

``Executor`` (``core``) is what the API talks to; each backend entry of the cluster config gets a
``ProcessBackend`` (``kind = "process"``, local processes with device slots), a ``RayBackend``
(``kind = "ray"``, a Ray cluster's Jobs API) or a ``SlurmBackend`` (``kind = "slurm"``, a Slurm
cluster's commands); the last two are imported only when configured.
"""

from iris.controller.executors.base import Backend, BackendUnreachable, Demand, demand_for, log_path_for
from iris.controller.executors.core import MAX_LOG_CHUNK, Executor
from iris.controller.executors.process import PASSTHROUGH_ENV, RUN_ID_ENV, ProcessBackend, kill_leftovers

__all__ = [
    "MAX_LOG_CHUNK",
    "PASSTHROUGH_ENV",
    "RUN_ID_ENV",
    "Backend",
    "BackendUnreachable",
    "Demand",
    "Executor",
    "ProcessBackend",
    "demand_for",
    "kill_leftovers",
    "log_path_for",
]
