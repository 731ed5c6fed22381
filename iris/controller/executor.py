"""Kept for imports written before the executors package; see ``iris.controller.executors``."""

from iris.controller.executors import (
    MAX_LOG_CHUNK,
    PASSTHROUGH_ENV,
    RUN_ID_ENV,
    Demand,
    Executor,
    demand_for,
    kill_leftovers,
    log_path_for,
)

__all__ = [
    "MAX_LOG_CHUNK",
    "PASSTHROUGH_ENV",
    "RUN_ID_ENV",
    "Demand",
    "Executor",
    "demand_for",
    "kill_leftovers",
    "log_path_for",
]
