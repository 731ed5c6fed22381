"""The federation store: queue handles, the reservation ledger, peer reports and waiting reasons.

SQLite by default (one file, embedded), PostgreSQL by URL; the schema is created and migrated on
open. See ``FederationStore`` for the transaction and locking rules behind the promotion CAS.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from iris.policy.explain import CANCELLED_BEFORE_HANDOFF, DEADLINE_PASSED
from iris.store.errors import StoreConflict, StoreError
from iris.store.models import CancelResult, Fence, HandleState, JobHandle, PromoteOutcome, PromoteResult

if TYPE_CHECKING:
    from iris.store.schema import LATEST_VERSION, MIGRATIONS, Migration
    from iris.store.store import FederationStore

# SQLAlchemy is imported on first use of these: the workflow code and the CLI import this
# package's models, not the engine (a third of a second of start-up on this machine).
_LAZY = {
    "LATEST_VERSION": "iris.store.schema",
    "MIGRATIONS": "iris.store.schema",
    "Migration": "iris.store.schema",
    "FederationStore": "iris.store.store",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'iris.store' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "CANCELLED_BEFORE_HANDOFF",
    "DEADLINE_PASSED",
    "LATEST_VERSION",
    "MIGRATIONS",
    "CancelResult",
    "FederationStore",
    "Fence",
    "HandleState",
    "JobHandle",
    "Migration",
    "PromoteOutcome",
    "PromoteResult",
    "StoreConflict",
    "StoreError",
]
