"""The headroom rule: min(free - R_unseen, total - R_all) - margin."""

from __future__ import annotations

from tests.unit.domain.builders import NOW, gpu, reservation
from vramshare.domain import ReservationPhase, headroom


def test_idle_gpu_headroom_is_free_minus_margin() -> None:
    room = headroom(gpu(total=16_384, used=0), [], settle_s=60, safety_margin_mib=512)
    assert room.headroom_mib == 16_384 - 512
    assert (room.reserved_mib, room.unseen_mib) == (0, 0)


def test_settled_pod_is_not_double_counted() -> None:
    # The pod has run for 10 min and uses its 4 GiB: it shows in `used` already.
    g = gpu(total=16_384, used=4_096)
    r = reservation(4_096, running_since=NOW - 600)
    room = headroom(g, [r], settle_s=60, safety_margin_mib=0)
    assert room.unseen_mib == 0
    assert room.headroom_mib == 16_384 - 4_096  # Kaapana's free-minus-reserved would give 8192


def test_reservation_whose_pod_has_not_started_is_subtracted_from_free() -> None:
    g = gpu(total=16_384, used=0)
    r = reservation(4_096, phase=ReservationPhase.RESERVED, running_since=None)
    room = headroom(g, [r], settle_s=60, safety_margin_mib=0)
    assert room.unseen_mib == 4_096
    assert room.headroom_mib == 16_384 - 4_096


def test_pod_started_too_recently_before_the_sample_counts_as_unseen() -> None:
    g = gpu(total=16_384, used=1_000, sampled_at=NOW)
    r = reservation(4_096, running_since=NOW - 30)  # settle time 60 s not reached at sample time
    room = headroom(g, [r], settle_s=60, safety_margin_mib=0)
    assert room.unseen_mib == 4_096
    assert room.headroom_mib == (16_384 - 1_000) - 4_096


def test_sample_older_than_the_pod_start_is_not_trusted() -> None:
    r = reservation(4_096, running_since=NOW - 100)
    g = gpu(total=16_384, used=0, sampled_at=NOW - 200)  # taken before the pod ran at all
    assert headroom(g, [r], settle_s=60, safety_margin_mib=0).unseen_mib == 4_096


def test_pod_using_less_than_asked_is_capped_by_the_ledger() -> None:
    g = gpu(total=16_384, used=1_000)
    r = reservation(12_000, running_since=NOW - 600)
    room = headroom(g, [r], settle_s=60, safety_margin_mib=0)
    assert room.headroom_mib == 16_384 - 12_000  # not the 15 384 that free alone suggests


def test_unknown_process_shrinks_headroom_through_free() -> None:
    g = gpu(total=16_384, used=10_000)  # nothing reserved, yet 10 GiB used by something
    assert headroom(g, [], settle_s=60, safety_margin_mib=512).headroom_mib == 6_384 - 512


def test_driver_reserved_memory_is_not_free() -> None:
    g = gpu(total=16_384, used=0, free=16_000)
    assert g.driver_reserved_mib == 384
    assert headroom(g, [], settle_s=60, safety_margin_mib=0).headroom_mib == 16_000


def test_only_active_reservations_on_this_gpu_count() -> None:
    g = gpu("GPU-a", total=16_384)
    others = [
        reservation(1_000, gpu_uuid="GPU-b"),
        reservation(2_000, phase=ReservationPhase.RELEASED),
        reservation(3_000, phase=ReservationPhase.EXPIRED),
    ]
    assert headroom(g, others, settle_s=60, safety_margin_mib=0).reserved_mib == 0


def test_lost_bookings_still_count() -> None:
    """Lost: the GPU blinked out while the pod runs; when it returns, that memory is still taken."""
    g = gpu("GPU-a", total=16_384)
    assert (
        headroom(
            g, [reservation(4_000, phase=ReservationPhase.LOST)], settle_s=60, safety_margin_mib=0
        ).reserved_mib
        == 4_000
    )


def test_ledger_only_ignores_live_free_memory() -> None:
    g = gpu(total=16_384, used=15_000)
    r = reservation(2_000)
    room = headroom(g, [r], settle_s=60, safety_margin_mib=100, ledger_only=True)
    assert room.ledger_only
    assert room.headroom_mib == 16_384 - 2_000 - 100


def test_driver_reserved_memory_is_never_promised_by_the_ledger() -> None:
    g = gpu(total=16_384, used=0, free=16_000)  # 384 MiB kept by the driver
    settled = reservation(15_000, running_since=NOW - 600)  # a pod that uses nothing of what it booked
    assert headroom(g, [settled], settle_s=60, safety_margin_mib=0).headroom_mib == 16_000 - 15_000
