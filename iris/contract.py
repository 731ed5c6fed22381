"""The Temporal contract of the federation: every name a client, a worker and an operator's tool
must agree on, in one place (docs/DESIGN.md, "The Temporal contract").

Workflow types, workflow ids, task queues, message names (signals, updates, queries), activity
names, search attributes, the memo key and the error types activities raise. The workflows and
activities declare themselves under these names; the SDK sends a job's messages by typed reference to
the workflow's methods (``handle.signal(JobWorkflow.cancel, ...)``), which carry the same names, and
the placement manager's Updates by these names (``QUEUE_POSITIONS``, ``DRY_RUN``: `iris job list`
loads no workflow code). A test (``tests/test_contract.py``) checks both sides against this module,
and that no other module of the product spells one of these names as a string.

Changing a value here renames something in running histories: it breaks every run in flight.
"""

from __future__ import annotations

from temporalio.common import SearchAttributeKey

# ---- workflow types ------------------------------------------------------------------------------

JOB_WORKFLOW = "JobWorkflow"
PLACEMENT_MANAGER = "PlacementManager"
LIST_PEERS = "ListPeers"
PEER_WATCH = "PeerWatch"

# ---- task queues and workflow ids ----------------------------------------------------------------

PLACEMENT_QUEUE_SUFFIX = "-placement"
_MANAGER_ID_PREFIX = "iris-placement-manager/"
_LIST_PEERS_ID_PREFIX = "iris-rpc/list-peers/"
_PEER_WATCH_ID_PREFIX = "iris-peer-watch/"


def job_workflow_id(job_id: str) -> str:
    """A job's workflow id is its job id: the UI, the CLI and the peers share one name."""
    return job_id


def manager_workflow_id(task_queue: str) -> str:
    """One placement manager per task queue (one federation per queue)."""
    return _MANAGER_ID_PREFIX + task_queue


def placement_task_queue(task_queue: str) -> str:
    """The placement manager's own task queue: its ticks never wait behind the jobs' tasks."""
    if task_queue.endswith(PLACEMENT_QUEUE_SUFFIX):
        return task_queue
    return task_queue + PLACEMENT_QUEUE_SUFFIX


def list_peers_workflow_id(unique: str) -> str:
    return _LIST_PEERS_ID_PREFIX + unique


def peer_watch_workflow_id(task_queue: str, cluster: str) -> str:
    """One watcher of each cluster's change feed per task queue (docs/DESIGN.md, "Mirroring")."""
    return f"{_PEER_WATCH_ID_PREFIX}{task_queue}/{cluster}"


# Every workflow id the federation starts for itself begins with one of these; no job may take one.
INTERNAL_WORKFLOW_ID_PREFIXES = (_MANAGER_ID_PREFIX, _LIST_PEERS_ID_PREFIX, _PEER_WATCH_ID_PREFIX)


def is_internal_workflow_id(workflow_id: str) -> bool:
    """Whether ``workflow_id`` is, or could become, one of the federation's own workflows (the
    placement manager, an RPC): a job holding it would keep that workflow from starting."""
    return workflow_id.startswith(INTERNAL_WORKFLOW_ID_PREFIXES)


# ---- messages ------------------------------------------------------------------------------------
# JobWorkflow: signals from the placement tick (place, explain_reason, expire; explain is the older
# text-only form of explain_reason, kept for runs that still hold one) and the SDK (cancel); the
# Updates an answer is needed for (cancel_job: did the cancel win?; replay_handoff: an operator's);
# the status query; from its cluster's watcher, what changed there (observe); from a reader of its
# logs, a refresh of the relayed copy (want_logs). PlacementManager: the wake signal, the
# last_tick query and the clients' Updates (queue_positions, dry_run).

PLACE = "place"
EXPLAIN = "explain"
EXPLAIN_REASON = "explain_reason"
EXPIRE = "expire"
CANCEL = "cancel"
CANCEL_JOB = "cancel_job"
REPLAY_HANDOFF = "replay_handoff"
STATUS = "status"
WAKE = "wake"
LAST_TICK = "last_tick"
# PlacementManager Updates: what a client asks of the queue (docs/DESIGN.md, "Queue position and
# dry-run"), answered by a local activity reading the store.
QUEUE_POSITIONS = "queue_positions"
DRY_RUN = "dry_run"
OBSERVE = "observe"
WANT_LOGS = "want_logs"

# ---- activities ----------------------------------------------------------------------------------

FETCH_REPORTS = "fetch_reports"
CHECK_ARTIFACTS = "check_artifacts"
STAGE_BUNDLE = "stage_bundle"
LAUNCH_JOB = "launch_job"
MIRROR_JOB = "mirror_job"
FOLLOW_JOB = "follow_job"
FIND_ATTEMPT = "find_attempt"
TERMINATE_JOB = "terminate_job"
ENQUEUE_JOB = "enqueue_job"
PROMOTE_JOB = "promote_job"
RECORD_CANCEL = "record_cancel"
EXPIRE_JOB = "expire_job"
SET_HANDLE_STATE = "set_handle_state"
REQUEUE_JOB = "requeue_job"
RECORD_FENCE = "record_fence"
PLACEMENT_TICK = "placement_tick"
VERIFY_REQUEST = "verify_request"
# The signature check and the capacity read of a new job, in one activity (ADMISSION: the baseline
# job-baseline-2027-01).
ADMIT_SUBMISSION = "admit_submission"
WATCH_PEER = "watch_peer"
READ_QUEUE_POSITIONS = "read_queue_positions"
PLAN_DRY_RUN = "plan_dry_run"

# ---- error types activities raise (ApplicationError.type) ----------------------------------------

# A cluster refused the job or its bundle: final, never retried (HANDOFF_REJECTED).
HANDOFF_REJECTED = "HandoffRejected"
# The cluster that ran the job no longer knows it.
JOB_LOST = "JobLost"
# The job's workspace bundle is not (intact) in the home store: nothing to stage until an operator acts.
BUNDLE_UNAVAILABLE = "BundleUnavailable"
# The cluster answered a launch that it does not hold the job's bundle: the job was not received
# there, and the workflow stages the bundle (BUILDING) before it launches again.
BUNDLE_MISSING = "BundleMissing"
# The federation store refused a handle transition (an answer, not an outage: never retried).
STORE_CONFLICT = "StoreConflict"
# A submission, cancel or replay whose signed statement is missing, forged, expired or not allowed.
UNAUTHENTICATED = "Unauthenticated"

# ---- visibility ----------------------------------------------------------------------------------
# Registered in every environment (dev server flags, test fixtures, the compose bootstrap): a
# workflow upserting one the server does not know fails its task for ever (docs/DESIGN.md).

SA_STATE = SearchAttributeKey.for_keyword("IrisState")
SA_PEER = SearchAttributeKey.for_keyword("IrisPeer")
SA_DEVICE_VARIANT = SearchAttributeKey.for_keyword("IrisDeviceVariant")
SA_BAND = SearchAttributeKey.for_keyword("IrisBand")
SA_SUBMITTER = SearchAttributeKey.for_keyword("IrisSubmitter")
# The job's current reason code (iris/policy/reasons.py), e.g. IrisReason = 'NoCapacity'.
SA_REASON = SearchAttributeKey.for_keyword("IrisReason")
SEARCH_ATTRIBUTE_KEYS = (SA_STATE, SA_PEER, SA_DEVICE_VARIANT, SA_BAND, SA_SUBMITTER, SA_REASON)
SEARCH_ATTRIBUTES: dict[str, str] = {key.name: "Keyword" for key in SEARCH_ATTRIBUTE_KEYS}
# The memo key holding a job's current reason (so `iris job list` needs no query per job).
MEMO_REASON = "reason"

MESSAGE_NAMES = (
    PLACE,
    EXPLAIN,
    EXPLAIN_REASON,
    EXPIRE,
    CANCEL,
    CANCEL_JOB,
    REPLAY_HANDOFF,
    STATUS,
    WAKE,
    LAST_TICK,
    QUEUE_POSITIONS,
    DRY_RUN,
    OBSERVE,
    WANT_LOGS,
)
ACTIVITY_NAMES = (
    FETCH_REPORTS,
    CHECK_ARTIFACTS,
    STAGE_BUNDLE,
    LAUNCH_JOB,
    MIRROR_JOB,
    FOLLOW_JOB,
    FIND_ATTEMPT,
    TERMINATE_JOB,
    ENQUEUE_JOB,
    PROMOTE_JOB,
    RECORD_CANCEL,
    EXPIRE_JOB,
    SET_HANDLE_STATE,
    REQUEUE_JOB,
    RECORD_FENCE,
    PLACEMENT_TICK,
    VERIFY_REQUEST,
    ADMIT_SUBMISSION,
    WATCH_PEER,
    READ_QUEUE_POSITIONS,
    PLAN_DRY_RUN,
)
WORKFLOW_TYPES = (JOB_WORKFLOW, PLACEMENT_MANAGER, LIST_PEERS, PEER_WATCH)
ERROR_TYPES = (
    HANDOFF_REJECTED,
    JOB_LOST,
    BUNDLE_UNAVAILABLE,
    BUNDLE_MISSING,
    STORE_CONFLICT,
    UNAUTHENTICATED,
)
