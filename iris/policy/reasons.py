"""Stable reason codes: why a job waits, or why it ended (docs/DESIGN.md, "Reason codes").

A code is a machine-readable word beside the human reason text: it never changes once published,
so scripts, dashboards (the ``reason`` label of ``iris_queued_jobs``) and visibility queries
(``IrisReason = 'NoCapacity'``) can rely on it while the text stays free to improve. Pure data:
the policy names the codes of its verdicts, the job workflow those of its states.
"""

from __future__ import annotations

from enum import StrEnum


class ReasonCode(StrEnum):
    """Why a job is where it is: a wait in the queue (``WAITING_CODES``), a handoff or a run under
    way, a parked handoff, or an end. Every member is documented in docs/DESIGN.md, "Reason codes"."""

    # On its way, nothing to explain: classifying, queued before a placement tick has looked at it,
    # or promoted (or run at home) and being handed off (artifact check, bundle staging, launch).
    Pending = "Pending"
    # Every candidate peer that answers with the job's shape is full for its band (what earlier
    # promotions hold in the ledger counts as taken).
    NoCapacity = "NoCapacity"
    # The job is pinned to a peer whose backends for its shape are full.
    PinnedPeerFull = "PinnedPeerFull"
    # Alone in the queue it would have been placed this tick: jobs ahead of it in the planner's
    # order (a higher band, or earlier in its band's fair-share order) took the capacity first, or
    # a peer's per-tick placement cap was reached.
    Priority = "Priority"
    # Devices are held for it (backfill, docs/DESIGN.md "Backfill"): none of its backends is free
    # enough now, and on one of them enough will be once the jobs there reach their time limits;
    # until then only jobs that end before that start may use them. ``describe`` shows where and
    # from when.
    Reserved = "Reserved"
    # Not a wait: the code of a promotion that went ahead of a job devices were held for, because
    # its time limit ends before that job's reserved start (backfill). ``describe`` shows it on the
    # promotion's event line.
    Backfilled = "Backfilled"
    # Its user holds as many devices as a cap in the config allows (``[quotas]``: in all, or in
    # the job's band), counting what this tick placed: it waits for the user's own jobs to end.
    UserQuota = "UserQuota"
    # The peers that could host the job do not answer (a queued job); or the cluster it was handed
    # to does not answer (parked with the launch's outcome unknown, or silent while it runs).
    PeerUnreachable = "PeerUnreachable"
    # The peers that could host the job answer with a report older than the staleness bound.
    PeerStale = "PeerStale"
    # No backend in the federation (or on the pinned peer) offers the job's shape: rejected at
    # submit, or left waiting because the peers that had it stopped advertising it.
    ShapeMismatch = "ShapeMismatch"
    # Handed off, waiting for devices on its cluster, or running there: nothing is wrong.
    Running = "Running"
    # Ended: every replica exited 0.
    Succeeded = "Succeeded"
    # Ended: a replica exited non-zero (or its cluster reports the job failed).
    ExitNonZero = "ExitNonZero"
    # Ended: an attempt ran past its --timeout.
    Timeout = "Timeout"
    # Ended: its cluster lost the attempt (worker died, job forgotten, or silent for too long)
    # and no retry was left.
    PeerLost = "PeerLost"
    # Its cluster preempted the attempt for a job of a higher band (docs/DESIGN.md, "Preemption"):
    # queued again as its next attempt (until a tick explains the wait), or ended with no retry left.
    Preempted = "Preempted"
    # Ended at submit: the submission's signed statement did not verify, or its principal may not
    # submit it (another user's job id, a workflow id other than its job id, a band it may not use).
    SubmissionRefused = "SubmissionRefused"
    # Ended at submit: the workflow's input is not a job spec the SDK would submit (undecodable,
    # malformed, beyond a limit, or a value a cluster's launch would refuse).
    InvalidSubmission = "InvalidSubmission"
    # Ended at submit: the job needs more on one backend (its gang: count x replicas chips, or
    # one CPU slot per replica) than any backend of its shape has in all, by the totals its
    # clusters report; a backend whose total is unknown never counts against it.
    TooLarge = "TooLarge"
    # Ended: cancelled by its owner or an admin (before handoff, or terminated on its cluster).
    Cancelled = "Cancelled"
    # Ended: its scheduling timeout passed before any cluster had room.
    DeadlinePassed = "DeadlinePassed"
    # Parked: an input artifact does not exist in the destination's object store.
    ArtifactMissing = "ArtifactMissing"
    # Parked: the handoff could not complete (an outage past the retries that the cluster confirms
    # never reached it, a bundle that cannot be staged, an artifact check that cannot be made); it
    # waits for an operator's replay or a cancel.
    HandoffFailed = "HandoffFailed"
    # Ended: the chosen cluster refused the job (or its bundle) for good.
    HandoffRefused = "HandoffRefused"

    @property
    def waiting(self) -> bool:
        """A code that explains a wait rather than an end."""
        return self in WAITING_CODES


WAITING_CODES = frozenset(
    {
        ReasonCode.Pending,
        ReasonCode.NoCapacity,
        ReasonCode.PinnedPeerFull,
        ReasonCode.Priority,
        ReasonCode.Reserved,
        ReasonCode.UserQuota,
        ReasonCode.PeerUnreachable,
        ReasonCode.PeerStale,
        ReasonCode.ShapeMismatch,
        ReasonCode.Preempted,
    }
)
