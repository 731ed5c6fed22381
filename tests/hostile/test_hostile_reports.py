"""Hostile capacity reports (docs/DESIGN.md, "Capacity reports", "3. No backend is over-committed"):
a malformed or lying peer never crashes the tick and never creates capacity.

Two levels: the pure planner over every report a parse lets through (hypothesis), and the tick
activity itself polling a fake peer controller that answers whatever bytes a case sets, followed by
the promotion CAS of each placement the tick makes (which charges the ledger).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from budget import scaled
from hostile_peer import HostilePeer
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st
from pydantic import ValidationError
from stack import Stack
from temporalio.testing import ActivityEnvironment

from activities.placement import PlacementActivities, TickInput
from iris.controller.models import BackendsResponse
from iris.policy import plan
from iris.policy.models import (
    BackendReport,
    Band,
    DeviceRequest,
    JobShape,
    PeerReport,
    Placement,
    PlanResult,
)
from iris.store import FederationStore, JobHandle

HOSTILE = "cw-rno2a"
NOW = 1_700_000_000_000
GPU_ATTRS = {"device-type": ["gpu"], "device-variant": ["h100"]}

# ---- the pure planner ------------------------------------------------------------------------

garbage: st.SearchStrategy[Any] = st.sampled_from(
    ["NaN", "Infinity", "-1", "8", "1e9", "", None, 1.5, 8.0, [], {}, True, -(2**70), 2**70]
)
# Numbers a parse accepts but an honest controller never sends, mixed with plausible ones.
hostile_ints = st.one_of(
    st.integers(-4, 24),
    st.integers(-4, 24),
    st.integers(-4, 24),
    st.sampled_from([-(2**63), -1, 0, 2**31, 2**63 - 1, 10**30]),
)
tokens = st.sampled_from(["h100", "h100", "h100", "H100", " h100 ", "a100", "", "h100\x00"])


def block_strategy(
    values: st.SearchStrategy[Any], epochs: st.SearchStrategy[Any], bands: st.SearchStrategy[Any]
) -> st.SearchStrategy[Any]:
    return st.fixed_dictionaries(
        {
            "version": st.one_of(*[st.just(1)] * 6, st.sampled_from([0, 2, 99]), values),
            "amounts": st.dictionaries(tokens, values, max_size=3),
        },
        optional={
            "observation_epoch_ms": epochs,
            "total_amounts": st.dictionaries(tokens, values, max_size=3),
            "held_by_band": st.lists(
                st.fixed_dictionaries(
                    {"band": bands},
                    optional={"amounts": st.dictionaries(tokens, values, max_size=2)},
                ),
                max_size=3,
            ),
            # Exempt holdings only ever take away from what is reclaimable.
            "exempt_by_band": st.lists(
                st.fixed_dictionaries(
                    {"band": bands},
                    optional={"amounts": st.dictionaries(tokens, values, max_size=2)},
                ),
                max_size=2,
            ),
        },
    )


def body_strategy(
    values: st.SearchStrategy[Any], epochs: st.SearchStrategy[Any], bands: st.SearchStrategy[Any]
) -> st.SearchStrategy[Any]:
    blocks = block_strategy(values, epochs, bands)
    backends = st.fixed_dictionaries(
        {
            "backend_id": st.sampled_from(["h100-rno2a", "h100-rno2a", "h100-us-east-02a", ""]),
            "advertised_attributes": st.sampled_from([GPU_ATTRS, GPU_ATTRS, GPU_ATTRS, {}]),
        },
        optional={"availability": st.one_of(st.none(), *[blocks] * 5)},
    )
    return st.fixed_dictionaries(
        {
            "cluster": st.sampled_from([HOSTILE, "cw-us-east-02a", "marin", ""]),
            "backends": st.lists(backends, max_size=4),
        }
    )


# Every value a parse lets through: what the planner must survive and never turn into capacity.
parsable_bodies = body_strategy(hostile_ints, st.integers(0, 2**63 - 1), st.integers(1, 3))
# Anything at all, garbage included: most of these are unusable, and must be refused, not crash.
garbage_bodies = body_strategy(
    st.one_of(hostile_ints, garbage),
    st.one_of(st.integers(), garbage),
    st.one_of(st.integers(-1, 5), garbage),
)


def parse_report(peer_id: str, raw: object) -> PeerReport:
    """What the manager makes of a peer's answer (iris.reports.cluster_report, minus the HTTP)."""
    try:
        resp = BackendsResponse.model_validate_json(json.dumps(raw))
    except ValidationError:
        return PeerReport(peer_id=peer_id, reachable=False, error="malformed report")
    # The peer is known by the address the manager polled, whatever id it claims.
    return PeerReport(peer_id=peer_id, reachable=True, last_contact_ms=NOW, backends=resp.backends)


def capacity_ceiling(backend: BackendReport) -> int:
    """The most h100 any reading of one backend's own claims could offer: idle plus everything held,
    never more than its declared total."""
    block = backend.availability
    if block is None:
        return 0

    def h100(amounts: dict[str, int]) -> int:
        return sum(max(0, v) for k, v in amounts.items() if k.strip().lower() == "h100")

    ceiling = h100(block.amounts) + sum(h100(entry.amounts) for entry in block.held_by_band)
    totals = [v for k, v in block.total_amounts.items() if k.strip().lower() == "h100"]
    return min(ceiling, h100(block.total_amounts)) if totals else ceiling


def jobs() -> list[JobShape]:
    shapes = []
    for i, band in enumerate([Band.PRODUCTION, Band.INTERACTIVE, Band.BATCH] * 4):
        shapes.append(
            JobShape(
                job_id=f"j{i:02d}",
                device=DeviceRequest(type="gpu", variant="h100", count=1 + (i % 3) * 3),
                band=band,
                submit_ms=i,
                target_cluster=HOSTILE if i % 2 else None,
            )
        )
    return shapes


def plan_against(body: dict[str, Any]) -> tuple[PeerReport, PlanResult]:
    report = parse_report(HOSTILE, body)
    home = PeerReport(peer_id="marin", reachable=True, last_contact_ms=NOW)
    return report, plan(jobs(), home="marin", reports=[home, report], now_ms=NOW, stale_after_ms=30_000)


@settings(max_examples=scaled(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=garbage_bodies)
def test_the_planner_survives_any_report_and_an_unusable_one_hosts_nothing(body: dict[str, Any]) -> None:
    report, result = plan_against(body)
    if not report.reachable:
        assert result.placements == []


@settings(max_examples=scaled(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=parsable_bodies)
def test_the_planner_never_creates_capacity_from_a_hostile_report(body: dict[str, Any]) -> None:
    report, result = plan_against(body)
    assert report.reachable
    first: dict[str, BackendReport] = {}
    for b in report.backends:
        first.setdefault(b.backend_id, b)  # a duplicated backend id keeps its first entry
    reserved: dict[str, int] = {}
    for p in result.placements:
        assert p.peer_id == HOSTILE
        if p.verified:
            reserved[p.backend_id] = reserved.get(p.backend_id, 0) + p.reserved.get("h100", 0)
        else:
            assert p.reserved == {}  # shape-only (no block, or a version it does not read)
    for backend_id, taken in reserved.items():
        assert taken <= capacity_ceiling(first[backend_id]), (backend_id, taken, first[backend_id])
    # Steer the search towards reports the planner does spend capacity on.
    target(float(sum(reserved.values())), label="h100 reserved on the hostile peer")


def test_the_parse_is_the_boundary() -> None:
    """Wrong types, NaN-like strings and out-of-range numbers make the whole report unusable."""
    for bad in (
        {"cluster": HOSTILE, "backends": "lots"},
        {"cluster": HOSTILE},
        {"cluster": HOSTILE, "backends": [{"advertised_attributes": GPU_ATTRS}]},
        {"cluster": HOSTILE, "backends": [{"backend_id": "b", "availability": {"amounts": {"h100": "NaN"}}}]},
        {"cluster": HOSTILE, "backends": [{"backend_id": "b", "availability": {"amounts": {"h100": 1.5}}}]},
        {
            "cluster": HOSTILE,
            "backends": [{"backend_id": "b", "availability": {"observation_epoch_ms": 10**30}}],
        },
        {"cluster": HOSTILE, "backends": [{"backend_id": "b", "availability": {"observation_epoch_ms": -5}}]},
        {
            "cluster": HOSTILE,
            "backends": [{"backend_id": "b", "availability": {"held_by_band": [{"band": 9, "amounts": {}}]}}],
        },
    ):
        assert not parse_report(HOSTILE, bad).reachable, bad


# ---- the tick activity against a fake peer ----------------------------------------------------


def backend(backend_id: str = "h100-rno2a", **block: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"backend_id": backend_id, "advertised_attributes": GPU_ATTRS}
    if block:
        entry["availability"] = {"version": 1, "observation_epoch_ms": NOW, **block}
    return entry


def body(*entries: dict[str, Any], cluster: str = HOSTILE) -> bytes:
    return json.dumps({"cluster": cluster, "backends": list(entries)}).encode()


@dataclass
class ReportCase:
    id: str
    body: bytes
    reachable: bool
    # The most h100 the tick may hand to the hostile peer (None: shape-only placements only).
    ceiling: int | None = 0
    status: int = 200


CASES = [
    ReportCase("not-json", b"{not json", reachable=False),
    ReportCase("empty-body", b"", reachable=False),
    ReportCase("deeply-nested", b"[" * 100_000, reachable=False),
    ReportCase("http-500", b'{"code":"UNAVAILABLE","message":"x"}', reachable=False, status=500),
    ReportCase("backends-wrong-type", b'{"cluster":"cw-rno2a","backends":"lots"}', reachable=False),
    ReportCase("missing-backends", b'{"cluster":"cw-rno2a"}', reachable=False),
    ReportCase("missing-backend-id", body({"advertised_attributes": GPU_ATTRS}), reachable=False),
    ReportCase("nan-string", body(backend(amounts={"h100": "NaN"})), reachable=False),
    ReportCase(
        "nan-literal", body(backend(amounts={"h100": 1})).replace(b'"h100": 1}', b'"h100": NaN}'), False
    ),
    ReportCase("fractional", body(backend(amounts={"h100": 0.5})), reachable=False),
    ReportCase(
        "invalid-band", body(backend(held_by_band=[{"band": 0, "amounts": {"h100": 8}}])), reachable=False
    ),
    ReportCase(
        "huge-epoch", body(backend(amounts={"h100": 8}, observation_epoch_ms=10**30)), reachable=False
    ),
    ReportCase("negative-free", body(backend(amounts={"h100": -100}, total_amounts={"h100": 8})), True, 0),
    ReportCase(
        "negative-held",
        body(backend(amounts={"h100": 0}, held_by_band=[{"band": 3, "amounts": {"h100": -50}}])),
        True,
        0,
    ),
    ReportCase("huge-free", body(backend(amounts={"h100": 10**30}, total_amounts={"h100": 8})), True, 8),
    ReportCase(
        "huge-held",
        body(
            backend(
                amounts={}, total_amounts={"h100": 8}, held_by_band=[{"band": 3, "amounts": {"h100": 10**9}}]
            )
        ),
        True,
        8,
    ),
    ReportCase(
        "case-duplicated-token",
        body(backend(amounts={"H100": 8, "h100": 8}, total_amounts={"h100": 8})),
        True,
        8,
    ),
    ReportCase("unknown-version", body(backend(version=99, amounts={"h100": 10**6})), True, None),
    ReportCase(
        "duplicated-backend",
        body(backend(amounts={"h100": 0}, total_amounts={"h100": 8}), backend(amounts={"h100": 8})),
        True,
        0,
    ),
    # Another cluster's controller at this cluster's address: its capacity is not this cluster's.
    ReportCase(
        "claims-another-peer",
        body(
            backend("h100-us-east-02a", amounts={"h100": 64}, total_amounts={"h100": 64}),
            cluster="cw-us-east-02a",
        ),
        reachable=False,
    ),
    ReportCase("extra-fields", body({**backend(amounts={"h100": 8}), "evil": True}), True, 8),
]


class RecordingTick(PlacementActivities):
    """The real tick; the signals it would send to job workflows are recorded instead."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.sent: list[tuple[str, str, object]] = []

    async def _signal(self, job_id: str, name: str, arg: object) -> bool:
        self.sent.append((job_id, name, arg))
        return False  # every job's workflow is there: nothing abandoned


def queue(store: FederationStore) -> None:
    now = int(time.time() * 1000)
    for i, band in enumerate([Band.PRODUCTION, Band.INTERACTIVE, Band.INTERACTIVE, Band.BATCH]):
        shape = JobShape(
            job_id=f"hostile/pinned-{i}",
            device=DeviceRequest(type="gpu", variant="h100", count=8),
            band=band,
            submit_ms=now + i,
            target_cluster=HOSTILE,
        )
        store.enqueue(JobHandle(job_id=shape.job_id, incarnation="inc", shape=shape, updated_ms=now))
    cpu = JobShape(job_id="hostile/cpu", submit_ms=now + 9, target_cluster=HOSTILE)
    store.enqueue(JobHandle(job_id=cpu.job_id, incarnation="inc", shape=cpu, updated_ms=now))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
async def test_a_hostile_peer_never_crashes_the_tick_nor_creates_capacity(
    stack: Stack, hostile_peer: HostilePeer, tmp_path: Path, case: ReportCase
) -> None:
    hostile_peer.body = case.body
    hostile_peer.status = case.status
    cfg = stack.config.model_copy(deep=True)
    cfg.cluster(HOSTILE).port = hostile_peer.port
    cfg.temporal.task_queue = f"iris-hostile-{uuid.uuid4().hex[:6]}"
    store = FederationStore(f"sqlite:///{tmp_path / 'federation.db'}")
    try:
        await asyncio.to_thread(queue, store)
        tick = RecordingTick(cfg, store)
        seen = hostile_peer.requests
        outcome = await ActivityEnvironment(client=stack.client).run(tick.placement_tick, TickInput())
        assert hostile_peer.requests > seen  # the tick really asked the hostile peer
        assert (HOSTILE in outcome.reachable) is case.reachable, outcome
        stored = next(r for r in await asyncio.to_thread(store.load_reports) if r.peer_id == HOSTILE)
        assert stored.reachable is case.reachable
        if case.id == "claims-another-peer":
            assert "answers as 'cw-us-east-02a', not 'cw-rno2a'" in (stored.error or ""), stored.error
        placements = [arg for _, name, arg in tick.sent if name == "place" and isinstance(arg, Placement)]
        gated = [p for p in placements if p.job_id != "hostile/cpu"]
        assert all(p.peer_id == HOSTILE for p in placements)  # everything queued is pinned to it
        if not case.reachable:
            assert placements == []
            return
        # Each placement goes through the promotion CAS, which charges the ledger: never a crash.
        promoted = 0
        for p in placements:
            result = await asyncio.to_thread(store.promote, p.job_id, "inc", p, int(time.time() * 1000))
            if result.promoted and p.job_id != "hostile/cpu":
                promoted += p.reserved.get("h100", 0) if p.verified else 0
        if case.ceiling is None:
            assert all(not p.verified and p.reserved == {} for p in gated)
        else:
            assert sum(p.reserved.get("h100", 0) for p in gated) <= case.ceiling
            assert all(p.verified for p in gated)
            ledger = await asyncio.to_thread(store.reservations)
            assert sum(r.amounts.get("h100", 0) for r in ledger if r.peer_id == HOSTILE) <= case.ceiling
            assert promoted <= case.ceiling
        # A peer claiming another's id or backend never lends that peer capacity.
        for r in await asyncio.to_thread(store.load_reports):
            if r.peer_id == "cw-us-east-02a":
                assert [b.backend_id for b in r.backends] == ["h100-us-east-02a"]
    finally:
        store.close()
