"""Every patch of the workflows (docs/DESIGN.md, "Determinism check"), and the one place that asks
``workflow.patched``: JobWorkflow's, then the PlacementManager's (``retick_when_saturated``).

A patch records a marker the first time a run asks it, and a replay expects that marker where the
run first asked: the moment of each question is part of the history. ``read`` asks the patches of
a run's first task, in their order, into a frozen ``Features``; the others are asked where the
lifecycle first needs them, each by a function of its own below (``home_ledger``,
``stages_bundle``, ``relays_terminal_launch``, ``asks_earlier_attempt``, ``launches_first``), and
``authenticates``
by whichever comes first, a handler or ``read``. The SDK memoizes every answer for the run.
Since BASELINE_PATCH each of them asks ``baseline`` first: a run begun with it writes one marker,
not one per patch; a run begun before it replays the questions it asked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from temporalio import workflow

# Runs started with this patch do the federation-store writes (all but the promotion CAS) as
# local activities, and upsert a search attribute only when its value changes (issue 9). Runs
# recorded before it replay on the old path.
LOCAL_STEPS_PATCH = "local-store-steps-v1"
# Runs that reach a handoff with this patch stage the job's workspace bundle on the destination
# first (BUILDING). A run that an older worker began without staging replays without it.
BUNDLE_PATCH = "workspace-bundle-v1"
# Runs with this patch relay the output of a job whose (repeated) launch found it already ended.
TERMINAL_LAUNCH_PATCH = "relay-after-terminal-launch-v1"
# Runs with this patch follow each attempt with follow_job (a silent cluster loses the attempt after
# peer_lost_after) and retry a failed or lost attempt within the job's budgets; after a launch whose
# answer never came they ask the cluster whether it has the attempt before parking (issue 15).
ATTEMPTS_PATCH = "attempts-v1"
# Runs with this patch reserve home capacity for a LOCAL job through the queue's CAS and ledger
# (issue 15); a run begun before it goes home without a reservation.
HOME_LEDGER_PATCH = "home-ledger-v1"
# Runs with this patch continue as new past CONTINUE_AFTER_EVENTS history events, at a quiet point
# of a long wait (queued, following an attempt, parked), handing the whole JobRun to the next run
# (docs/DESIGN.md, "Bounded histories").
CONTINUE_PATCH = "continue-as-new-v1"
# Runs with this patch, before a later attempt on a cluster that lost an earlier one, ask that
# cluster how the earlier attempt ended: one that succeeded while the cluster was silent is the
# job's result (no second run), one still running there is terminated first (as before).
EARLIER_ATTEMPT_PATCH = "earlier-attempt-v1"
# Runs with this patch verify the submitter's signed statement before classifying (a job that does
# not verify ends REJECTED), verify each cancel and replay (one that does not is recorded and
# ignored), and hand off under the verified principal (docs/DESIGN.md, "User → home").
# Until it answers: the answer is the verdict (a refusal is final, never retried), and an outage of
# the check must not refuse a valid job.
AUTH_PATCH = "authenticated-submitters-v1"
# Runs with this patch, while their cluster's watcher signals its changes (the view's
# mirror_safety_poll_s > 0), follow a running attempt by those signals, asking the cluster
# themselves only every mirror_safety_poll_s (the safety poll), after a notice that it is silent,
# and while a reader wants the log relayed (docs/DESIGN.md, "Mirroring"). No activity is held per
# running job.
FEED_PATCH = "change-feed-v1"
# Runs with this patch upsert the IrisReason search attribute (the stable code of the job's reason,
# docs/DESIGN.md, "Reason codes") whenever the code changes. Asked at the top of every run, before
# the run's first reason is set, so that every reason of the run is upserted or not alike.
REASON_PATCH = "reason-code-v1"
# Runs with this patch tell an attempt its cluster preempted for a higher band (PREEMPTED,
# docs/DESIGN.md, "Preemption") from one it lost: the job is queued again with the code Preempted
# and the cluster's "preempted by <job id> at <time>" in its reason, its attempt records that, ends
# Preempted when no retry is left, and a later attempt on that cluster does not ask after it. A run
# that predates the patch treats it as a lost attempt (PeerLost). Asked in the first task of every
# run, as FEED_PATCH.
PREEMPT_PATCH = "preemption-v1"
# Runs with this patch take the handoff's retry schedule (the launch and the bundle staging) and a
# parked job's probes from the view they were classified with (its handoff_retry_initial_s,
# handoff_retry_max_s, parked_probe_first_s and parked_probe_max_s, from the federation config:
# docs/DESIGN.md, "Errors, retries and parking"); a run that predates it keeps HANDOFF_RETRY and
# PROBE_FIRST/PROBE_MAX (the views' defaults are the same values). Asked in the first task of
# every run, as FEED_PATCH.
TIMERS_PATCH = "handoff-timers-v1"
# Runs with this patch take no internal signal on trust (docs/SECURITY.md, "Internal signals";
# docs/DESIGN.md, "Messages taken on trust"): a placement is re-checked against the job's pin and
# constraints and promoted with the job's own reservation (iris/policy/vetting.py, on the view the
# job was classified with, read again when it cannot vouch); an observation applies only to the
# attempt whose nonce it carries, a terminal one only once its cluster confirms it, and a silence
# notice's start is measured, not taken from the notice; an expiry ends only a queued job whose
# own deadline has passed. A message refused is recorded as an event and ignored. Asked in the
# first task of every run, as FEED_PATCH.
SIGNALS_PATCH = "checked-internal-signals-v1"
# Runs with this patch admit a new job only if its start holds one input, a JobSpec the SDK would
# submit (JobSpec.check), started under its own job id, and, once its statement verifies, whose
# job id is under its signer's prefix (iris.jobs.user_prefix); anything else ends REJECTED
# (InvalidSubmission, SubmissionRefused) in its first task, having started nothing. A start that
# carries a JobRun without continuing a run is one of them. A launch request its cluster would
# refuse parks the job instead of failing its task. Asked at the top of every run.
SUBMISSION_PATCH = "checked-submissions-v1"
# Runs with this patch reject at classification a job that no backend of its shape can ever hold:
# its whole gate on one backend is more than every matching backend's reported total, none of them
# unknown (iris/policy/sizing.py; docs/DESIGN.md, "Classification": "Never fits"). It ends REJECTED
# with the code TooLarge, naming the largest matching backend; a run begun before it queues such a
# job for ever. Asked in a new run's first task, with ATTEMPTS_PATCH.
SIZE_PATCH = "oversized-rejected-v1"
# Runs with this patch free a parked job's capacity at once when the job is known not to run on its
# cluster: the park came before any launch of the attempt went unanswered (``maybe_on`` unset), or
# the cluster since confirmed it never received the job. The handle's reservation is deleted with
# the park (set_handle_state release); a replay in place takes it again through the CAS (promote_job
# retake: the same cluster and backend, the ledger checked as for any promotion) and, refused because
# another job took the capacity meanwhile, goes back to the queue. A launch whose outcome is unknown
# keeps the reservation until its cluster answers (docs/DESIGN.md, "Errors, retries and parking").
# A run that predates it keeps the reservation while parked, as before. Asked in the first task of
# every run, as FEED_PATCH.
PARK_PATCH = "parked-frees-capacity-v1"
# Runs with this patch never fail a job for a band preemption (docs/DESIGN.md, "Preemption"): an
# attempt its cluster preempted for a higher band queues the job again without spending any budget;
# --max-retries-preemption counts only attempts a cluster lost. A run that predates it spends that
# budget on a preemption and ends Preempted when none is left. With it too, a job queued again for
# its next attempt counts as not delivered until that attempt's launch: Temporal's own cancel there
# ends it KILLED before handoff (before it, the cancel read the ended attempt back from its cluster
# and the job ended with that attempt's end). Asked in the first task of every run, as FEED_PATCH.
REQUEUE_PATCH = "preemption-requeues-v1"
# Runs with this patch read an end a watcher reported back from its cluster (confirm_end:
# mirror_job, the status and the last of the output relayed home) as a local activity, in the
# workflow task that took the observation, instead of a regular activity and two more tasks
# (docs/DESIGN.md, "A burst of ends"). A run that predates it reads it as before. Asked in the
# first task of every run, as FEED_PATCH.
LOCAL_CONFIRM_PATCH = "local-end-confirm-v1"
# Runs with this patch take every patch above without asking each (docs/DESIGN.md, "Determinism
# check": "One marker per run"). Each ``workflow.patched`` that answers yes writes a marker and an
# upsert of TemporalChangeVersion, which the server indexes: 14 of each in a new job's first task,
# and up to 5 more later, a third of a job's history events (issue 31). A run with this patch writes
# one of each. It is asked first in every run's first task (by ``read``, or before it by a handler
# through ``authenticates``). A run that predates it finds no marker and asks each patch as before;
# a patch added after it is asked on its own again.
BASELINE_PATCH = "job-baseline-2026-12"
# Runs with this patch take BASELINE_PATCH's features and LAUNCH_FIRST_PATCH without asking
# either, and admit a new job with one activity (ADMISSION: admit_submission checks the signature
# and reads the capacity reports, activities/admission.py) instead of verify_request then
# fetch_reports: one activity and one workflow task fewer per job (issue 31). Asked first in
# every run's first task, before BASELINE_PATCH; a run that predates it replays as before.
BASELINE_2027_PATCH = "job-baseline-2027-01"
# Runs with this patch take BASELINE_2027_PATCH's features without asking it, and run the
# promotion CAS (promote_job) as a local activity in the workflow task that took the placement,
# instead of a regular activity whose answer comes in a task of its own: one activity and one
# workflow task fewer per promotion, and the promotion's state change written in the task that
# schedules the launch (issue 31; docs/DESIGN.md, "Promotion (the CAS)"). An operator's reset of a
# refused handoff goes back to that task and runs the CAS again: the store answers it
# ALREADY_PROMOTED (iris/store/store.py, ``_not_queued``). Asked first in every run's first task,
# before BASELINE_2027_PATCH; a run that predates it replays as before.
BASELINE_2027_02_PATCH = "job-baseline-2027-02"
# Patches after the baseline, each asked on its own.
#
# Runs with this patch launch a job that has a workspace bundle at once, and stage the bundle
# (BUILDING) only when the cluster answers that it does not hold it; the launch is then sent again
# (docs/DESIGN.md, "Workspace bundles"). A sweep's jobs after the first skip a staging activity,
# a workflow task and two state changes each (issue 31). A run that predates it stages first.
# Asked at a handoff of a job that has a bundle, not before.
LAUNCH_FIRST_PATCH = "launch-before-staging-v1"


@dataclasses.dataclass(frozen=True)
class Features:
    """What this run does, by the patches it saw (each flag: the patch above that decides it)."""

    # SUBMISSION_PATCH: the start's input is checked (a refused one ends REJECTED).
    checked: bool = False
    # REASON_PATCH: IrisReason is upserted per change of code.
    reasons: bool = False
    # LOCAL_STEPS_PATCH: store writes as local activities, upserts only on change. A continued
    # run keeps the first run's answer (JobRun.local_steps).
    local_steps: bool = False
    # CONTINUE_PATCH and ATTEMPTS_PATCH: True in every continued run (only a run with both
    # continues as new). SIZE_PATCH: asked only where a job is classified, in its first run.
    can_continue: bool = False
    numbered: bool = False
    sizing: bool = False
    # AUTH_PATCH, FEED_PATCH, PREEMPT_PATCH, TIMERS_PATCH, SIGNALS_PATCH, PARK_PATCH, REQUEUE_PATCH,
    # LOCAL_CONFIRM_PATCH: asked in the first task of every run.
    authenticating: bool = False
    feed: bool = False
    preemption: bool = False
    timers: bool = False
    wary: bool = False
    frees: bool = False
    requeues: bool = False
    # LOCAL_CONFIRM_PATCH: a reported end is read back from its cluster by a local activity.
    local_confirm: bool = False
    # BASELINE_2027_PATCH: a new job is admitted by one activity (signature and reports).
    admits: bool = False
    # BASELINE_2027_02_PATCH: the promotion CAS is a local activity.
    promotes_locally: bool = False


def read(
    *,
    first_run: Callable[[bool], bool],
    classifying: Callable[[bool, bool], None],
    carried_local_steps: bool,
) -> Features:
    """The patches of a run's first task, in the order their markers stand in every history.

    ``first_run(checked)`` says whether this run begins a job (no JobRun, or a start's forged
    one once inputs are checked); it may raise (a run before SUBMISSION_PATCH whose input cannot
    be read failed its task). ``classifying(reasons, local_steps)`` shows a new job CLASSIFYING:
    its memo and search attributes are written between LOCAL_STEPS_PATCH's marker and
    CONTINUE_PATCH's, where every recorded first run has them."""
    if baseline():
        return _from_baseline(first_run, classifying, carried_local_steps)
    checked = workflow.patched(SUBMISSION_PATCH)
    fresh = first_run(checked)
    # First, so that every reason this run sets is upserted alike (see REASON_PATCH).
    reasons = workflow.patched(REASON_PATCH)
    if fresh:
        local_steps = workflow.patched(LOCAL_STEPS_PATCH)
        classifying(reasons, local_steps)
        # Asked here, before any local activity, not where attempts first matter: a patch marker
        # recorded in the workflow task that also completes a slow local activity (the SDK then
        # heartbeats that task) may land ahead of the activity's own marker, and a replay that
        # first asks after the activity finds it out of place (nondeterminism).
        can_continue = workflow.patched(CONTINUE_PATCH)
        numbered = workflow.patched(ATTEMPTS_PATCH)
        sizing = workflow.patched(SIZE_PATCH)
    else:
        local_steps, can_continue, numbered, sizing = carried_local_steps, True, True, False
    # Likewise in the first task, not where a running attempt is first followed: asked there, a
    # marker could land in a task that also completes a slow local activity (see above).
    return Features(
        checked=checked,
        reasons=reasons,
        local_steps=local_steps,
        can_continue=can_continue,
        numbered=numbered,
        sizing=sizing,
        authenticating=authenticates(),
        feed=workflow.patched(FEED_PATCH),
        preemption=workflow.patched(PREEMPT_PATCH),
        timers=workflow.patched(TIMERS_PATCH),
        wary=workflow.patched(SIGNALS_PATCH),
        frees=workflow.patched(PARK_PATCH),
        requeues=workflow.patched(REQUEUE_PATCH),
        local_confirm=workflow.patched(LOCAL_CONFIRM_PATCH),
    )


def _from_baseline(
    first_run: Callable[[bool], bool], classifying: Callable[[bool, bool], None], carried_local_steps: bool
) -> Features:
    """A run begun with BASELINE_PATCH: every earlier patch taken, none asked (``read``); sizing
    and local_steps as for any run (only a first run classifies; a continued run keeps its
    local_steps)."""
    fresh = first_run(True)
    if fresh:
        classifying(True, True)
    return Features(
        admits=current_baseline(),
        promotes_locally=newest_baseline(),
        checked=True,
        reasons=True,
        local_steps=True if fresh else carried_local_steps,
        can_continue=True,
        numbered=True,
        sizing=fresh,
        authenticating=True,
        feed=True,
        preemption=True,
        timers=True,
        wary=True,
        frees=True,
        requeues=True,
        local_confirm=True,
    )


def authenticates() -> bool:
    """AUTH_PATCH, asked by whichever comes first: ``read`` or a handler (a signed cancel or replay
    can arrive in the very first task, before ``run`` starts)."""
    return baseline() or workflow.patched(AUTH_PATCH)


def baseline() -> bool:
    """BASELINE_PATCH, or the later BASELINE_2027_PATCH that implies it: asked first in every run's
    first task (by ``read`` or ``authenticates``). The SDK memoizes each answer, so a later
    question here writes nothing: yes for a run that began with either, no for one that began
    before both (its replay found no marker). A run begun with the later one never asks the
    earlier (one marker per run)."""
    return current_baseline() or workflow.patched(BASELINE_PATCH)


def current_baseline() -> bool:
    """BASELINE_2027_PATCH, or the later BASELINE_2027_02_PATCH that implies it (asked first, so a
    run begun with the later one never asks the earlier)."""
    return newest_baseline() or workflow.patched(BASELINE_2027_PATCH)


def newest_baseline() -> bool:
    """BASELINE_2027_02_PATCH: the first patch every run's first task asks (through ``baseline``)."""
    return workflow.patched(BASELINE_2027_02_PATCH)


def home_ledger() -> bool:
    """HOME_LEDGER_PATCH: asked when a job classified LOCAL has a placement, not before."""
    return baseline() or workflow.patched(HOME_LEDGER_PATCH)


def stages_bundle() -> bool:
    """BUNDLE_PATCH: asked at each handoff of a job that has a bundle."""
    return baseline() or workflow.patched(BUNDLE_PATCH)


def launches_first() -> bool:
    """LAUNCH_FIRST_PATCH: asked at a handoff of a job that has a bundle (after BUNDLE_PATCH);
    taken without asking by a run begun with BASELINE_2027_PATCH."""
    return current_baseline() or workflow.patched(LAUNCH_FIRST_PATCH)


def relays_terminal_launch() -> bool:
    """TERMINAL_LAUNCH_PATCH: asked when a launch answers with a job already ended."""
    return baseline() or workflow.patched(TERMINAL_LAUNCH_PATCH)


def asks_earlier_attempt() -> bool:
    """EARLIER_ATTEMPT_PATCH: asked (by a run that numbers attempts) before a later attempt's
    launch, for each earlier attempt its cluster lost."""
    return baseline() or workflow.patched(EARLIER_ATTEMPT_PATCH)


# The PlacementManager's one patch: a tick that hit the per-peer cap with jobs left waiting is
# followed at once by another (a manager begun before it waits for the interval, as before).
RETICK_PATCH = "retick-when-saturated-v1"


def retick_when_saturated() -> bool:
    """RETICK_PATCH: asked by the manager after each saturated tick, not before."""
    return workflow.patched(RETICK_PATCH)
