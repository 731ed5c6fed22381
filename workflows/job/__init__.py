"""The job workflow (docs/DESIGN.md, "Data flow", "Job states", "The phase machine").

classify → run at home now | queue → placement signal → promotion CAS → artifact check → bundle
staging → handoff → follow → terminal, with cancellation honoured at every step. No I/O here:
activities do it and the policy decides.

- ``workflow.py``: the ``@workflow.defn`` shell, its message handlers and the loop over the phases.
- ``state.py``: the one serialisable ``JobRun``, its ``Mailbox``, the ``Phase`` enum.
- ``transitions.py``: the phase table and ``move``, the one writer of what users see.
- ``steps/``: one module per phase (classify, queue, handoff and launch, follow and attempt,
  parked, cancel), each returning the next phase.
- ``effects.py``: the activity calls, their timeouts and retries.
- ``versions.py``: every patch, read once per run into ``Features``.
- ``ends.py``: how an attempt ends and what the job then shows; ``messages.py``: what the
  handlers write; ``legacy.py``: how runs before numbered attempts follow their job.

This module re-exports the names other modules import from ``workflows.job``.
"""

from __future__ import annotations

from workflows.job.effects import HANDOFF_RETRY as _HANDOFF_RETRY
from workflows.job.effects import PROBE_FIRST as _PROBE_FIRST
from workflows.job.effects import PROBE_MAX as _PROBE_MAX
from workflows.job.steps.cancel import CANCELLED_WHILE_PARKED
from workflows.job.workflow import JobWorkflow
from workflows.versions import (
    ATTEMPTS_PATCH,
    AUTH_PATCH,
    BASELINE_2027_02_PATCH,
    BASELINE_2027_PATCH,
    BASELINE_PATCH,
    BUNDLE_PATCH,
    CONTINUE_PATCH,
    EARLIER_ATTEMPT_PATCH,
    FEED_PATCH,
    HOME_LEDGER_PATCH,
    LAUNCH_FIRST_PATCH,
    LOCAL_CONFIRM_PATCH,
    LOCAL_STEPS_PATCH,
    PARK_PATCH,
    PREEMPT_PATCH,
    REASON_PATCH,
    REQUEUE_PATCH,
    SIGNALS_PATCH,
    SIZE_PATCH,
    SUBMISSION_PATCH,
    TERMINAL_LAUNCH_PATCH,
    TIMERS_PATCH,
)

__all__ = (
    "ATTEMPTS_PATCH",
    "AUTH_PATCH",
    "BASELINE_2027_02_PATCH",
    "BASELINE_2027_PATCH",
    "BASELINE_PATCH",
    "BUNDLE_PATCH",
    "CANCELLED_WHILE_PARKED",
    "CONTINUE_PATCH",
    "EARLIER_ATTEMPT_PATCH",
    "FEED_PATCH",
    "HOME_LEDGER_PATCH",
    "LAUNCH_FIRST_PATCH",
    "LOCAL_CONFIRM_PATCH",
    "LOCAL_STEPS_PATCH",
    "PARK_PATCH",
    "PREEMPT_PATCH",
    "REASON_PATCH",
    "REQUEUE_PATCH",
    "SIGNALS_PATCH",
    "SIZE_PATCH",
    "SUBMISSION_PATCH",
    "TERMINAL_LAUNCH_PATCH",
    "TIMERS_PATCH",
    "_HANDOFF_RETRY",
    "_PROBE_FIRST",
    "_PROBE_MAX",
    "JobWorkflow",
)
