"""Availability: gate, versioned blocks, effective capacity by band, ledger replay, staleness
(docs/DESIGN.md, "Placement")."""

from __future__ import annotations

from policy_factories import EPOCH, NOW, STALE, backend, gpu_attrs, h100, peer

from iris.policy import (
    BackendReport,
    Band,
    Capacity,
    DeviceRequest,
    HeldByBand,
    PeerStatus,
    Reservation,
    effective_capacity,
    gate,
    live_reservations,
    peer_status,
    usable_block,
    working_capacity,
)


def res(amount: int, *, epoch: int = EPOCH, band: Band | None = None, peer_id: str = "cw") -> Reservation:
    return Reservation(
        peer_id=peer_id, backend_id="b", observation_epoch_ms=epoch, amounts={"h100": amount}, band=band
    )


class TestGate:
    def test_gpu_with_variant_is_gated_on_all_replicas(self) -> None:
        assert gate(DeviceRequest(type="gpu", variant="h100", count=8, replicas=3)) == ("h100", 24)

    def test_variant_token_is_lowercased(self) -> None:
        assert gate(DeviceRequest(type="GPU", variant="H100", count=1)) == ("h100", 1)

    def test_cpu_is_gated_one_slot_per_replica(self) -> None:
        # Was "not gated" before issue 15: CPU is now a token, counted like the process backend's
        # slots (one per replica).
        assert gate(DeviceRequest()) == ("cpu", 1)
        assert gate(DeviceRequest(type="CPU", replicas=5)) == ("cpu", 5)

    def test_auto_and_tpu_are_not_gated(self) -> None:
        assert gate(DeviceRequest(type="gpu", variant="auto", count=8)) is None
        assert gate(DeviceRequest(type="tpu", variant="tpu-v5p", count=4)) is None

    def test_zero_chips_is_not_gated(self) -> None:
        assert gate(DeviceRequest(type="gpu", variant="h100", count=0)) is None


class TestVersioning:
    def test_absent_block_is_shape_only(self) -> None:
        assert usable_block(backend("b", gpu_attrs(), legacy=True)) is None

    def test_unknown_version_is_shape_only(self) -> None:
        assert usable_block(backend("b", gpu_attrs(), free={"h100": 8}, version=2)) is None
        assert working_capacity("cw", backend("b", gpu_attrs(), free={"h100": 8}, version=0)) is None

    def test_empty_amounts_is_nothing_free(self) -> None:
        assert effective_capacity("cw", backend("b", gpu_attrs(), free={}), "h100", Band.PRODUCTION) == 0

    def test_tokens_are_lowercased_and_negative_amounts_clamped(self) -> None:
        cap = working_capacity("cw", backend("b", gpu_attrs(), free={"H100": 8, "a100": -3}))
        assert cap is not None
        assert (cap.idle("h100"), cap.idle("a100")) == (8, 0)


class TestBands:
    b = h100("b", 2, held={Band.BATCH: 4, Band.INTERACTIVE: 8, Band.PRODUCTION: 16})

    def test_production_reclaims_interactive_and_batch(self) -> None:
        assert effective_capacity("cw", self.b, "h100", Band.PRODUCTION) == 2 + 4 + 8

    def test_interactive_reclaims_only_batch(self) -> None:
        assert effective_capacity("cw", self.b, "h100", Band.INTERACTIVE) == 2 + 4

    def test_batch_reclaims_nothing(self) -> None:
        assert effective_capacity("cw", self.b, "h100", Band.BATCH) == 2

    def test_spend_takes_idle_then_lowest_band_first(self) -> None:
        cap = Capacity({"h100": 2}, {Band.BATCH: {"h100": 4}, Band.INTERACTIVE: {"h100": 8}})
        assert cap.spend("h100", 10, Band.PRODUCTION) == 0
        assert cap.free == {"h100": 0}
        assert cap.held == {Band.BATCH: {"h100": 0}, Band.INTERACTIVE: {"h100": 4}}

    def test_spend_never_reclaims_own_band(self) -> None:
        cap = Capacity({"h100": 0}, {Band.INTERACTIVE: {"h100": 8}})
        assert cap.spend("h100", 8, Band.INTERACTIVE) == 8
        assert cap.held[Band.INTERACTIVE] == {"h100": 8}

    def test_exempt_holdings_are_not_reclaimable(self) -> None:
        """What work back from a preemption holds within its preempt_exempt_s (``exempt_by_band``,
        a part of ``held_by_band``) is offered to no band but production, which overrides the
        exemption; an older peer's block has none."""
        b = h100("b", 2, held={Band.BATCH: 4, Band.INTERACTIVE: 8})
        assert b.availability is not None
        block = b.availability.model_copy(
            update={
                "exempt_by_band": [
                    HeldByBand(band=Band.BATCH, amounts={"H100": 3}),
                    HeldByBand(band=Band.INTERACTIVE, amounts={"h100": 20, "a100": 5}),
                    HeldByBand(band=Band.PRODUCTION, amounts={"h100": 1}),  # nothing held: ignored
                ]
            }
        )
        exempt = b.model_copy(update={"availability": block})
        # Production: idle, batch (1 not exempt + 3 exempt) and interactive (8, all exempt).
        assert effective_capacity("cw", exempt, "h100", Band.PRODUCTION) == 2 + 4 + 8
        assert effective_capacity("cw", exempt, "h100", Band.INTERACTIVE) == 2 + 1
        assert effective_capacity("cw", exempt, "h100", Band.BATCH) == 2
        # A report without the field (an older peer) reads as before.
        old = BackendReport.model_validate_json(
            b.model_dump_json(exclude={"availability": {"exempt_by_band"}})
        )
        assert effective_capacity("cw", old, "h100", Band.PRODUCTION) == 2 + 4 + 8
        assert effective_capacity("cw", old, "h100", Band.INTERACTIVE) == 2 + 4

    def test_production_spends_exempt_holdings_last(self) -> None:
        """A production placement charged to a block takes idle, then reclaimable, then exempt
        capacity: what is left for the next job reads right for every band."""
        b = h100("b", 2, held={Band.BATCH: 6})
        assert b.availability is not None
        block = b.availability.model_copy(
            update={"exempt_by_band": [HeldByBand(band=Band.BATCH, amounts={"h100": 4})]}
        )
        cap = Capacity.from_block(block)
        assert (cap.effective("h100", Band.PRODUCTION), cap.effective("h100", Band.INTERACTIVE)) == (8, 4)
        assert cap.spend("h100", 5, Band.PRODUCTION) == 0  # 2 idle, 2 reclaimable, 1 exempt
        assert (cap.idle("h100"), cap.effective("h100", Band.INTERACTIVE)) == (0, 0)
        assert cap.effective("h100", Band.PRODUCTION) == 3
        copy = cap.copy()
        assert copy.spend("h100", 4, Band.PRODUCTION) == 1
        assert cap.effective("h100", Band.PRODUCTION) == 3  # the copy is its own


class TestLedger:
    def test_reservation_on_same_observation_is_charged(self) -> None:
        cap = working_capacity("cw", h100("b", 16), [res(8)])
        assert cap is not None and cap.idle("h100") == 8

    def test_newer_observation_frees_the_ledger(self) -> None:
        cap = working_capacity("cw", h100("b", 16), [res(8, epoch=EPOCH - 5_000)])
        assert cap is not None and cap.idle("h100") == 16

    def test_other_backend_or_peer_is_not_charged(self) -> None:
        cap = working_capacity("cw", h100("b", 16), [res(8, peer_id="other")])
        assert cap is not None and cap.idle("h100") == 16

    def test_replay_respects_the_reservation_band(self) -> None:
        # An interactive reservation could only have taken idle and batch capacity.
        b = h100("b", 0, held={Band.BATCH: 4, Band.INTERACTIVE: 8})
        cap = working_capacity("cw", b, [res(8, band=Band.INTERACTIVE)])
        assert cap is not None
        assert cap.effective("h100", Band.PRODUCTION) == 8
        assert cap.held[Band.INTERACTIVE]["h100"] == 8

    def test_overdrawn_ledger_empties_the_backend_without_going_negative(self) -> None:
        cap = working_capacity("cw", h100("b", 4), [res(8)])
        assert cap is not None and cap.effective("h100", Band.PRODUCTION) == 0

    def test_live_reservations_drop_old_observations_and_keep_unreachable_peers(self) -> None:
        current, old = res(1), res(2, epoch=EPOCH - 1)
        down = res(3, peer_id="down")
        gone = res(4, peer_id="gone")
        reports = [peer("cw", h100("b", 16)), peer("down", reachable=False)]
        assert live_reservations([current, old, down, gone], reports) == [current, down]


class TestStaleness:
    def test_fresh_report_is_ok(self) -> None:
        assert peer_status(peer("cw"), NOW, STALE) is PeerStatus.OK

    def test_report_older_than_the_bound_is_stale(self) -> None:
        assert peer_status(peer("cw", last_contact_ms=NOW - STALE - 1), NOW, STALE) is PeerStatus.STALE
        assert peer_status(peer("cw", last_contact_ms=NOW - STALE), NOW, STALE) is PeerStatus.OK

    def test_never_contacted_is_stale(self) -> None:
        assert peer_status(peer("cw", last_contact_ms=None), NOW, STALE) is PeerStatus.STALE

    def test_unreachable_wins(self) -> None:
        assert peer_status(peer("cw", reachable=False), NOW, STALE) is PeerStatus.UNREACHABLE
