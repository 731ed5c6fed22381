"""A queued job's waiting reason keeps the tick's code beside it (docs/DESIGN.md, "Reason codes"):
a change of code alone is a change (the tick signals the job), and the code lives only as long as
the job waits in the queue."""

from __future__ import annotations

from sqlalchemy import text
from store_factories import NOW, PEER, Stores, gpu_backend, handle, placement, report

from iris.policy.reasons import ReasonCode
from iris.store import FederationStore


def test_a_change_of_code_alone_is_a_change(store: FederationStore) -> None:
    store.save_reports([report(PEER, gpu_backend(free=8))])
    for job_id in ("a", "b"):
        store.enqueue(handle(job_id))
    full = "Queued for a federation peer to report free capacity: full on cw (needs 8 h100)"
    reasons = {"a": full, "b": full}
    codes = {"a": ReasonCode.NoCapacity, "b": ReasonCode.NoCapacity}
    assert store.update_reasons(reasons, codes) == ["a", "b"]
    assert store.update_reasons(reasons, codes) == []
    # Same text: b waited behind a job ahead this time, a is still full.
    assert store.update_reasons(reasons, {**codes, "b": ReasonCode.Priority}) == ["b"]
    assert store.get("a").reason_code is ReasonCode.NoCapacity  # type: ignore[union-attr]
    assert store.get("b").reason_code is ReasonCode.Priority  # type: ignore[union-attr]
    # Without codes (an older tick), the stored code stays and only the text counts.
    assert store.update_reasons(reasons) == []
    assert store.update_reasons({"a": "another"}) == ["a"]
    assert store.get("a").reason_code is ReasonCode.NoCapacity  # type: ignore[union-attr]


def test_the_code_goes_when_the_job_leaves_the_queue(store: FederationStore) -> None:
    store.save_reports([report(PEER, gpu_backend(free=8))])
    store.enqueue(handle("j"))
    store.update_reasons({"j": "waiting"}, {"j": ReasonCode.PeerStale})
    assert store.promote("j", "inc-1", placement("j"), NOW).promoted
    promoted = store.get("j")
    assert promoted is not None and promoted.reason is None and promoted.reason_code is None
    # Requeued: a new wait, to be explained by the next tick.
    assert store.requeue("j", "inc-1")
    assert store.get("j").reason_code is None  # type: ignore[union-attr]


def test_a_code_this_version_does_not_know_reads_as_none(stores: Stores) -> None:
    store = stores.open()
    store.enqueue(handle("j"))
    store.update_reasons({"j": "waiting"}, {"j": ReasonCode.NoCapacity})
    # A newer worker wrote a code added after this version.
    store._run(lambda conn: conn.execute(text("UPDATE job_handles SET reason_code = 'SomethingNew'")))
    got = store.get("j")
    assert got is not None and got.reason == "waiting" and got.reason_code is None
