"""The federation store: queue handles, the reservation ledger, peer reports and waiting reasons.

SQLite by default (one file, embedded), PostgreSQL by URL; the schema is created and migrated on
open. See ``FederationStore`` for the transaction and locking rules behind the promotion CAS.
"""

from iris.store.errors import StoreConflict, StoreError
from iris.store.models import CancelResult, HandleState, JobHandle, PromoteOutcome, PromoteResult
from iris.store.schema import LATEST_VERSION, MIGRATIONS, Migration
from iris.store.store import CANCELLED_BEFORE_HANDOFF, DEADLINE_PASSED, FederationStore

__all__ = [
    "CANCELLED_BEFORE_HANDOFF",
    "DEADLINE_PASSED",
    "LATEST_VERSION",
    "MIGRATIONS",
    "CancelResult",
    "FederationStore",
    "HandleState",
    "JobHandle",
    "Migration",
    "PromoteOutcome",
    "PromoteResult",
    "StoreConflict",
    "StoreError",
]
