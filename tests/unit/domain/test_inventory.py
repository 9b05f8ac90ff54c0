"""Inventory states: Ready, Stale, Missing; outages never look like removed GPUs; overuse."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tests.unit.domain.builders import NOW, gpu, reservation
from vramshare.domain import Accounting, ReservationPhase
from vramshare.domain.inventory import DeviceState, InventorySettings, Known, Sample, observe, to_forget

SETTINGS = InventorySettings(
    accounting=Accounting(max_sample_age_s=30, safety_margin_mib=500), missing_grace_s=60
)


def sample(
    uuid: str, *, node: str = "node-a", used: int = 0, at: float = NOW, reserved: int | None = 100
) -> Sample:
    return Sample(
        uuid=uuid,
        node=node,
        index=0,
        model="A100",
        free_mib=16_000 - used,
        used_mib=used,
        driver_reserved_mib=reserved,
        sampled_at=at,
    )


def known(uuid: str, *, node: str = "node-a", seen: float = NOW - 10, sampled: float = NOW - 10) -> Known:
    return Known(gpu=gpu(uuid, node=node, total=16_100, sampled_at=sampled), last_seen_at=seen)


def states(statuses: list) -> dict[str, DeviceState]:
    return {s.gpu.uuid: s.state for s in statuses}


def test_sampled_gpus_are_ready_and_total_includes_driver_reserved() -> None:
    (s,) = observe(
        known=[],
        samples=[sample("GPU-1", used=1000)],
        reservations=[],
        nodes={"node-a"},
        now=NOW,
        settings=SETTINGS,
    )
    assert s.state is DeviceState.READY
    assert (s.gpu.total_mib, s.gpu.used_mib, s.gpu.free_mib) == (16_100, 1000, 15_000)
    assert s.last_seen_at == NOW
    assert s.headroom.headroom_mib == 15_000 - 500


def test_missing_fb_reserved_means_total_is_free_plus_used() -> None:
    (s,) = observe(
        known=[],
        samples=[sample("GPU-1", reserved=None)],
        reservations=[],
        nodes=None,
        now=NOW,
        settings=SETTINGS,
    )
    assert s.gpu.total_mib == 16_000


def test_old_sample_is_stale() -> None:
    (s,) = observe(
        known=[],
        samples=[sample("GPU-1", at=NOW - 31)],
        reservations=[],
        nodes=None,
        now=NOW,
        settings=SETTINGS,
    )
    assert s.state is DeviceState.STALE
    assert "31 s old" in s.message


def test_gpu_gone_while_its_node_reports_others_goes_missing_after_grace() -> None:
    within = observe(
        known=[known("GPU-old", seen=NOW - 59)],
        samples=[sample("GPU-other")],
        reservations=[],
        nodes={"node-a"},
        now=NOW,
        settings=SETTINGS,
    )
    assert states(within)["GPU-old"] is DeviceState.READY  # its last sample is still young enough
    after = observe(
        known=[known("GPU-old", seen=NOW - 60, sampled=NOW - 60)],
        samples=[sample("GPU-other")],
        reservations=[],
        nodes={"node-a"},
        now=NOW,
        settings=SETTINGS,
    )
    missing = next(s for s in after if s.gpu.uuid == "GPU-old")
    assert missing.state is DeviceState.MISSING
    assert missing.gpu.missing
    assert missing.headroom.headroom_mib == 0
    assert "while node node-a reports other GPUs" in missing.message


def test_replaced_card_is_a_new_device_and_the_old_one_goes_missing() -> None:
    out = observe(
        known=[known("GPU-old", seen=NOW - 120, sampled=NOW - 120)],
        samples=[sample("GPU-new")],
        reservations=[],
        nodes={"node-a"},
        now=NOW,
        settings=SETTINGS,
    )
    assert states(out) == {"GPU-new": DeviceState.READY, "GPU-old": DeviceState.MISSING}


def test_outage_makes_everything_stale_never_missing() -> None:
    old = [
        known("GPU-1", seen=NOW - 3600, sampled=NOW - 3600),
        known("GPU-2", seen=NOW - 3600, sampled=NOW - 3600),
    ]
    out = observe(known=old, samples=[], reservations=[], nodes={"node-a"}, now=NOW, settings=SETTINGS)
    assert set(states(out).values()) == {DeviceState.STALE}


def test_deleted_node_makes_its_gpus_missing() -> None:
    out = observe(
        known=[known("GPU-1", node="node-gone")],
        samples=[],
        reservations=[],
        nodes={"node-a"},
        now=NOW,
        settings=SETTINGS,
    )
    assert states(out) == {"GPU-1": DeviceState.MISSING}


def test_overuse_is_usage_beyond_reservations_plus_margin() -> None:
    held = [reservation(4_000, gpu_uuid="GPU-1", running_since=NOW - 600)]
    (within,) = observe(
        known=[],
        samples=[sample("GPU-1", used=4_400)],
        reservations=held,
        nodes=None,
        now=NOW,
        settings=SETTINGS,
    )
    assert within.overused_mib == 0
    (over,) = observe(
        known=[],
        samples=[sample("GPU-1", used=6_000)],
        reservations=held,
        nodes=None,
        now=NOW,
        settings=SETTINGS,
    )
    assert over.overused_mib == 1_500


@given(
    uuids=st.sets(st.sampled_from([f"GPU-{i}" for i in range(6)]), max_size=6),
    known_uuids=st.sets(st.sampled_from([f"GPU-{i}" for i in range(6)]), max_size=6),
)
def test_every_gpu_gets_exactly_one_status(uuids: set[str], known_uuids: set[str]) -> None:
    out = observe(
        known=[known(u) for u in known_uuids],
        samples=[sample(u) for u in uuids],
        reservations=[],
        nodes={"node-a"},
        now=NOW,
        settings=SETTINGS,
    )
    assert sorted(s.gpu.uuid for s in out) == sorted(uuids | known_uuids)
    for s in out:
        if s.gpu.uuid in uuids:
            assert s.state is DeviceState.READY


def test_a_hold_allows_no_usage_on_its_gpu() -> None:
    from dataclasses import replace

    from vramshare.domain import ReservationPhase

    booked = reservation(4_000, gpu_uuid="GPU-1", running_since=NOW - 600)
    hold = replace(
        reservation(8_000, gpu_uuid="GPU-1", phase=ReservationPhase.HELD, name="hold"), held_for="task"
    )
    (status,) = observe(
        known=[],
        samples=[sample("GPU-1", used=6_000)],
        reservations=[booked, hold],
        nodes=None,
        now=NOW,
        settings=SETTINGS,
    )
    assert status.overused_mib == 6_000 - 4_000 - 500


def test_a_gpu_gone_for_good_with_nothing_booked_is_forgotten() -> None:
    gone = Known(gpu=gpu("GPU-gone", index=1, sampled_at=NOW - 7200), last_seen_at=NOW - 7200)
    lost = Known(gpu=gpu("GPU-lost", index=2, sampled_at=NOW - 7200), last_seen_at=NOW - 7200)
    recent = Known(gpu=gpu("GPU-recent", index=3, sampled_at=NOW - 120), last_seen_at=NOW - 120)
    settings = InventorySettings(missing_grace_s=60, forget_missing_after_s=3600)
    statuses = observe(
        known=[gone, lost, recent],
        samples=[sample("GPU-alive")],
        reservations=[],
        nodes=None,
        now=NOW,
        settings=settings,
    )
    assert {s.gpu.uuid for s in statuses if s.state is DeviceState.MISSING} == {
        "GPU-gone",
        "GPU-lost",
        "GPU-recent",
    }
    booked = [reservation(1000, gpu_uuid="GPU-lost", phase=ReservationPhase.LOST)]
    forgotten = to_forget(statuses, reservations=booked, now=NOW, settings=settings)
    assert [s.gpu.uuid for s in forgotten] == ["GPU-gone"]  # a Lost booking keeps its GPU; recent waits
    never = InventorySettings(missing_grace_s=60, forget_missing_after_s=0)
    assert to_forget(statuses, reservations=[], now=NOW, settings=never) == []
