"""Acceptance 3 of issue 28: a ``JobRun`` carried through continue-as-new equals the one before.

A run continues as new with ``[spec, handover(run)]`` (workflows/job/state.py), encoded by the
project's data converter; the next run receives both untyped (as JSON) and reads them back with
``read_inputs``. Whatever the run holds, every field arrives: the code before JobRun copied
``_Job`` into a ``Carry`` field by field, and two copies drifted (``explanation_code`` and
``queued_since_ms`` were read back but never written: a queued job lost its reason's code and its
queue wait). Only the event list is trimmed (its first 20 and latest 200 kept).
"""

from __future__ import annotations

from typing import Any

from budget import scaled
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from job_doubles import PEER, federation_view, gpu_spec

from activities.watch import Observation
from iris.controller.models import ControllerJobState, TaskStatus
from iris.controller.models import JobStatus as RemoteStatus
from iris.jobs import (
    AttemptEnd,
    AttemptView,
    CancelRequest,
    JobEvent,
    JobSpec,
    JobState,
    JobStatus,
    ReplayRequest,
    TaskView,
)
from iris.policy.models import Band, Placement
from iris.policy.reasons import ReasonCode
from iris.temporal import data_converter
from workflows.job.state import EVENTS_HEAD, EVENTS_TAIL, JobRun, Mailbox, Phase, handover, read_inputs

SETTINGS = settings(max_examples=scaled(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
SPEC = gpu_spec("carried", 1_700_000_000_000)
text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
ms = st.integers(min_value=0, max_value=10**13)
maybe_text = st.none() | text


def events(max_size: int) -> st.SearchStrategy[list[JobEvent]]:
    event = st.builds(JobEvent, at_ms=ms, state=st.sampled_from(JobState), message=text)
    return st.lists(event, max_size=max_size)


attempts = st.lists(
    st.builds(
        AttemptView,
        number=st.integers(1, 9),
        cluster=text,
        backend_id=text,
        nonce=text,
        started_ms=ms,
        ended_ms=st.none() | ms,
        # Every value an attempt's end has held, NOT_DELIVERED included (issue 28).
        end=st.none() | st.sampled_from(list(AttemptEnd)),
        exit_code=st.none() | st.integers(-255, 255),
        reason=maybe_text,
        preempted=maybe_text,
    ),
    max_size=4,
)
remote = st.builds(
    RemoteStatus,
    job_id=st.just(SPEC.job_id),
    state=st.sampled_from(ControllerJobState),
    backend_id=text,
    exit_code=st.none() | st.integers(-255, 255),
    error=maybe_text,
    created_ms=ms,
    band=st.sampled_from(Band),
    user=text,
    requester=text,
    nonce=text,
    tasks=st.lists(st.builds(TaskStatus, index=st.integers(0, 3), state=st.sampled_from(ControllerJobState))),
    epoch=text,
    version=st.integers(0, 10**6),
)
placement = st.builds(
    Placement,
    job_id=st.just(SPEC.job_id),
    peer_id=text,
    backend_id=text,
    forced=st.booleans(),
    reason=text,
    reserved=st.dictionaries(text, st.integers(0, 64), max_size=2),
)


def statuses(max_events: int) -> st.SearchStrategy[JobStatus]:
    return st.builds(
        JobStatus,
        job_id=st.just(SPEC.job_id),
        state=st.sampled_from(JobState),
        reason=text,
        reason_code=st.none() | st.sampled_from(ReasonCode),
        disposition=maybe_text,
        cluster=maybe_text,
        backend_id=maybe_text,
        exit_code=st.none() | st.integers(-255, 255),
        cancel_requested=st.booleans(),
        submit_ms=st.just(SPEC.submit_ms),
        updated_ms=ms,
        events=events(max_events),
        tasks=st.lists(st.builds(TaskView, index=st.integers(0, 3), state=text), max_size=2),
        handoff_attempts=st.integers(0, 9),
        spec=st.just(SPEC),
        attempts=attempts,
    )


MAILBOX = {
    "placement": st.none() | placement,
    "vouched": st.booleans(),
    "cancel": st.none() | st.builds(CancelRequest, reason=text),
    "expire": st.booleans(),
    "replay": st.none()
    | st.builds(ReplayRequest, peer=maybe_text, requeue=st.booleans(), force=st.booleans()),
    "explanation": maybe_text,
    "explanation_code": st.none() | st.sampled_from(ReasonCode),
    "observed": st.none()
    | st.builds(Observation, cluster=text, status=st.none() | remote, silent_since_ms=st.none() | ms),
    "seen_version": st.none() | st.tuples(text, st.integers(0, 10**6)),
    "logs_until_ms": ms,
}


# Every field of a JobRun but its status (whose event count each test chooses).
RUN = {
    "spec": st.just(SPEC),
    "phase": st.sampled_from(Phase),
    "view": st.none() | st.just(federation_view(SPEC.submit_ms)),
    "cluster": text,
    "backend": text,
    "remote": st.none() | remote,
    "pin": maybe_text,
    "clusters": st.lists(text, max_size=3).map(tuple),
    "queued": st.booleans(),
    "delivered": st.booleans(),
    "local_steps": st.booleans(),
    "sa_state": maybe_text,
    "sa_reason": maybe_text,
    "memo_reason": maybe_text,
    "queued_since_ms": st.none() | ms,
    "attempt": st.integers(1, 9),
    "failures_retried": st.integers(0, 9),
    "preemptions_retried": st.integers(0, 9),
    "band_preemptions": st.integers(0, 9),
    "maybe_on": st.none() | st.tuples(text, text),
    "lost_after_s": st.floats(0, 1e6, allow_nan=False),
    "runs": st.integers(1, 10**4),
    "principal": maybe_text,
    "promoted": st.none() | placement,
    "released": st.booleans(),
    "mailbox": st.fixed_dictionaries(MAILBOX).map(lambda kw: Mailbox(**kw)),
}


def job_runs(max_events: int = EVENTS_HEAD + EVENTS_TAIL) -> st.SearchStrategy[JobRun]:
    fields: dict[str, st.SearchStrategy[Any]] = {**RUN, "status": statuses(max_events)}
    return st.fixed_dictionaries(fields).map(lambda kw: JobRun(**kw))


def carried(run: JobRun) -> JobRun:
    """``run`` through a continue-as-new: encoded as the run hands it over, decoded untyped as the
    next run receives it (``*inputs: Any``), read back as the next run reads it."""
    converter = data_converter().payload_converter
    payloads = converter.to_payloads([run.spec, handover(run)])
    spec, back, refused = read_inputs(tuple(converter.from_payloads(payloads)))
    assert refused is None and back is not None
    assert spec == run.spec
    return back


def test_the_strategy_sets_every_field_of_a_job_run() -> None:
    """A field added to JobRun or its Mailbox without a strategy here fails this test."""
    assert set(JobRun.model_fields) == {*RUN, "status"}
    assert set(Mailbox.model_fields) == set(MAILBOX)


@SETTINGS
@given(job_runs())
def test_a_job_run_carried_through_continue_as_new_equals_the_one_before(run: JobRun) -> None:
    assert carried(run) == run


@SETTINGS
@given(job_runs(max_events=EVENTS_HEAD + EVENTS_TAIL + 40), st.integers(1, 40))
def test_only_the_events_are_trimmed(run: JobRun, more: int) -> None:
    run.status.events += [JobEvent(at_ms=i, state=JobState.RUNNING, message=f"e{i}") for i in range(more)]
    back = carried(run)
    events = run.status.events
    if len(events) <= EVENTS_HEAD + EVENTS_TAIL:
        assert back == run
        return
    dropped = len(events) - EVENTS_HEAD - EVENTS_TAIL
    assert back.status.events[:EVENTS_HEAD] == events[:EVENTS_HEAD]
    assert back.status.events[EVENTS_HEAD].message == f"({dropped} events omitted)"
    assert back.status.events[EVENTS_HEAD + 1 :] == events[-EVENTS_TAIL:]
    back.status.events = events
    assert back == run


def test_the_drifted_fields_arrive() -> None:
    """The two fields the field-by-field copies lost, on a queued job's run."""
    run = JobRun(
        spec=SPEC,
        phase=Phase.QUEUED,
        status=JobStatus(job_id=SPEC.job_id, state=JobState.QUEUED_HANDOFF, spec=SPEC),
        view=federation_view(SPEC.submit_ms),
        cluster=PEER,
        queued=True,
        queued_since_ms=SPEC.submit_ms + 5_000,
        mailbox=Mailbox(explanation="cw-a full: 3 jobs ahead", explanation_code=ReasonCode.NoCapacity),
    )
    back = carried(run)
    assert back.mailbox.explanation_code is ReasonCode.NoCapacity
    assert back.queued_since_ms == SPEC.submit_ms + 5_000


def test_a_spec_is_not_carried_twice() -> None:
    """The spec is the continued run's first input, not a field of its JobRun payload."""
    run = JobRun(spec=SPEC, status=JobStatus(job_id=SPEC.job_id, state=JobState.CLASSIFYING))
    assert "spec" not in handover(run).model_dump(mode="json")
    assert isinstance(SPEC, JobSpec)
