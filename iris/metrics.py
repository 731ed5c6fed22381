"""The names and labels of Iris's own Prometheus metrics (docs/DESIGN.md, "Metrics").

One place for every ``iris_*`` name, so the emitters (the job workflow and the activities, through
the Temporal SDK's metric meter; the controllers, through prometheus_client), the dashboard under
``deploy/`` and the tests agree. Each constant is the name as Prometheus stores it: a histogram
adds ``_bucket``, ``_sum`` and ``_count`` to it, nothing else is added.

Emitted by the worker (workflow.metric_meter() in workflow code, activity.metric_meter() in
activities), served on the worker's Prometheus endpoint beside the SDK's own ``temporal_*``
(``iris worker --metrics-address``, iris/temporal.py). The SDK's exporter is used with its defaults:
counters keep their name (no ``_total``), no unit suffix, the SDK's own durations in milliseconds.
Every worker series also carries the meter's labels: ``namespace``, ``task_queue``,
``activity_type`` (activities) or ``workflow_type`` (workflow code), and ``service_name``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# ---- the worker --------------------------------------------------------------------------------

# Counter, by band and device (the job's device label, e.g. h100x8): jobs whose workflow began
# classifying them (workflow code).
JOBS_SUBMITTED = "iris_jobs_submitted"
# Histogram, seconds, by band and device: from entering the federation queue to a won promotion
# (workflow code).
QUEUE_WAIT = "iris_queue_wait_seconds"
# Gauge, by band, device_variant and reason (a ReasonCode): jobs in the federation queue, as the
# placement tick last saw them. A label set the last tick did not see is 0.
QUEUED_JOBS = "iris_queued_jobs"
# Counter, by peer and outcome (HANDOFF_OUTCOMES): launch requests sent to a cluster by the
# handoff, each counted once with its answer (an outage retried counts each try; a cancelled one
# is not counted).
HANDOFFS = "iris_handoffs"
# Gauge, by peer: 1 if the peer answered the tick's last poll, else 0.
PEER_REACHABLE = "iris_peer_reachable"
# Gauge, by peer, backend and device: free devices in the peer's last report (device: the report's
# token, e.g. h100; ``cpu`` counts CPU slots). 0 for a peer that did not answer.
PEER_FREE_DEVICES = "iris_peer_free_devices"
# Gauge, by user and band: the devices (accelerator chips) the user's jobs hold, as the tick's fair
# share and caps count them (docs/DESIGN.md, "Fair share and aging"). 0 once they hold none.
USER_DEVICES = "iris_user_devices"
# Gauge (float), by user: the user's dominant share of the federation's devices in use, 0 to 1, the
# share that orders its jobs within a band.
USER_SHARE = "iris_user_share"
# Histogram, seconds: one placement tick, whole: polling the peers, planning, the signals to the
# jobs, the look for abandoned handles and the fences.
PLACEMENT_TICK = "iris_placement_tick_seconds"
# Histogram, seconds, by peer: from a job's change on its cluster (the time the change's state
# began there: created, started or finished) to the watcher's signal telling its workflow (the
# change feed's propagation lag). Across two machines it includes their clock difference; a
# negative lag (a controller clock ahead) is recorded as 0.
MIRROR_LAG = "iris_mirror_propagation_lag_seconds"

# The outcomes of HANDOFFS: the cluster took the job (or already had it); refused it for good (a
# final error: HANDOFF_REJECTED); did not answer (an outage, retried); anything else (e.g. a token
# it did not accept, an unknown cluster).
HANDOFF_OUTCOMES = ("accepted", "refused", "unreachable", "error", "bundle_missing")

# The ``device_variant`` of QUEUED_JOBS: as the IrisDeviceVariant search attribute has it
# (iris/jobs.py, start_search_attributes): the device variant, ``cpu`` for a job without devices.
CPU_VARIANT = "cpu"

# Histogram buckets in seconds (the SDK's default buckets are for milliseconds), applied to the
# worker's Prometheus endpoint (iris/temporal.py) by metric name.
HISTOGRAM_BUCKETS: Mapping[str, Sequence[float]] = {
    PLACEMENT_TICK: (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
    MIRROR_LAG: (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0),
    QUEUE_WAIT: (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 14400.0, 86400.0),
}

# ---- every controller (GET /metrics, iris/controller/metrics.py) --------------------------------

# Counter, by method, route (the route's template, e.g. /v1/jobs/{job_id:path}; ``unmatched`` for
# a path no route has) and status (the HTTP status code): requests answered.
CONTROLLER_REQUESTS = "iris_controller_requests_total"
# Counter, by backend (a configured backend id, ``unknown`` for any other) and outcome
# (LAUNCH_OUTCOMES): POST /v1/jobs that reached the launch handler.
CONTROLLER_LAUNCHES = "iris_controller_launches_total"
# Gauge, by backend: the jobs RUNNING on each configured backend.
CONTROLLER_RUNNING_JOBS = "iris_controller_running_jobs"
# Gauge, by backend and device: free devices in the controller's own capacity report (device: the
# token, e.g. h100; ``cpu`` counts CPU slots). A backend whose engine does not answer is left out.
CONTROLLER_FREE_SLOTS = "iris_controller_free_slots"
# Counter, by reason (REFUSAL_REASONS): requests refused by authentication or admission.
CONTROLLER_REFUSALS = "iris_controller_refusals_total"

# The outcomes of CONTROLLER_LAUNCHES: a new run; the same run again (same requester and nonce); a
# refusal (CONTROLLER_REFUSALS says why); the named bundle is not here yet (the caller uploads it
# and launches again: not a refusal).
LAUNCH_OUTCOMES = ("accepted", "replayed", "refused", "bundle_missing")
# The reasons of CONTROLLER_REFUSALS (docs/DESIGN.md, "Admission order"): a token that does not
# verify (any route); the local_admin submitter; a requester other than the token's issuer; an
# issuer not allowed to hand off jobs; a user no allowed_submitters entry matches; a job id taken
# (another requester's, or a live run under another nonce); an unknown backend or a demand it can
# never meet.
REFUSAL_REASONS = (
    "unauthenticated",
    "local_admin",
    "requester_mismatch",
    "requester_not_trusted",
    "submitter_not_allowed",
    "already_exists",
    "unsupported_demand",
)

# Every iris_* name above (the dashboard's test checks its queries against these).
ALL_NAMES = (
    JOBS_SUBMITTED,
    QUEUE_WAIT,
    QUEUED_JOBS,
    HANDOFFS,
    PEER_REACHABLE,
    PEER_FREE_DEVICES,
    USER_DEVICES,
    USER_SHARE,
    PLACEMENT_TICK,
    MIRROR_LAG,
    CONTROLLER_REQUESTS,
    CONTROLLER_LAUNCHES,
    CONTROLLER_RUNNING_JOBS,
    CONTROLLER_FREE_SLOTS,
    CONTROLLER_REFUSALS,
)
HISTOGRAMS = (QUEUE_WAIT, PLACEMENT_TICK, MIRROR_LAG)
