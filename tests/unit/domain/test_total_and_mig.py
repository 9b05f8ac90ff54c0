"""A card's total is pinned (no reading can turn a running pod's growth into headroom), and a
MIG-enabled GPU is shown but never handed out."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from tests.unit.domain.builders import NOW, gpu, request, reservation
from vramshare.domain import Accounting, AllocationSettings, Choice, Exclusion, Refusal, choose
from vramshare.domain.inventory import DeviceState, InventorySettings, Known, Sample, TotalDrift, observe
from vramshare.domain.messages import refusal_message
from vramshare.domain.models import MigInstance

SETTINGS = InventorySettings(accounting=Accounting(max_sample_age_s=30, safety_margin_mib=512, settle_s=0))
CARD = 40_960  # an A100 40 GB: free + used + 512 reserved by the driver


def sample(*, free: int, used: int, at: float = NOW, capacity: int | None = None) -> Sample:
    return Sample(
        uuid="GPU-a",
        node="node-a",
        index=0,
        model="NVIDIA A100",
        free_mib=free,
        used_mib=used,
        driver_reserved_mib=512,
        sampled_at=at,
        capacity_mib=capacity,
    )


def known(*, used: int, drift: TotalDrift | None = None) -> Known:
    return Known(
        gpu=gpu(total=CARD, used=used, free=CARD - 512 - used, sampled_at=NOW - 5),
        last_seen_at=NOW - 5,
        drift=drift,
    )


def judge(s: Sample, k: Known) -> object:
    booked = [reservation(38_000, running_since=NOW - 300)]
    (status,) = observe(
        known=[k], samples=[s], reservations=booked, nodes={"node-a"}, now=NOW, settings=SETTINGS
    )
    return status


def test_a_reading_that_straddles_a_pods_growth_is_rejected_and_admits_nothing() -> None:
    """The issue's case: 38 GB booked on a 40 GB card; a pod grows 10 GiB inside its booking between
    the FB_FREE and FB_USED queries, so free is from before and used from after."""
    before = known(used=28_000)
    straddled = sample(free=CARD - 512 - 28_000, used=38_240)  # sums to 51 200 MiB
    status = judge(straddled, before)
    assert status.rejected
    assert "51200 MiB" in status.rejected
    assert "40960 MiB" in status.rejected
    assert status.gpu.total_mib == CARD
    assert status.gpu.used_mib == 28_000  # the last good figures
    assert status.gpu.sampled_at == NOW - 5  # which age: a rejection that lasts goes Stale
    assert status.headroom.headroom_mib < 11_000
    verdict = choose(
        request(11_000),
        [status.gpu],
        [reservation(38_000, running_since=NOW - 300)],
        settings=AllocationSettings(accounting=SETTINGS.accounting),
        now=NOW,
    )
    assert isinstance(verdict, Refusal)
    # Taken as it was read, the same sample would have admitted the 11 000 MiB pod: 49 GB on 40 GB.
    unpinned = choose(
        request(11_000),
        [straddled.to_gpu()],
        [reservation(38_000, running_since=NOW - 300)],
        settings=AllocationSettings(accounting=SETTINGS.accounting),
        now=NOW,
    )
    assert isinstance(unpinned, Choice)


def test_a_new_total_read_three_times_in_a_row_becomes_the_cards_total() -> None:
    k = known(used=0)
    resized = sample(free=30_000, used=0)  # 30 512: e.g. a MIG reconfiguration
    drift = None
    for readings in (1, 2):
        status = judge(resized, replace(k, drift=drift))
        assert status.rejected
        assert status.drift == TotalDrift(total_mib=30_512, readings=readings)
        drift = status.drift
    status = judge(resized, replace(k, drift=drift))
    assert not status.rejected
    assert status.drift is None
    assert status.gpu.total_mib == 30_512
    assert status.state is DeviceState.READY


def test_a_total_that_keeps_moving_is_never_taken() -> None:
    drift = None
    for n in range(6):
        status = judge(sample(free=20_000 + 1000 * n, used=0), replace(known(used=0), drift=drift))
        assert status.rejected
        assert status.drift is not None
        assert status.drift.readings == 1
        drift = status.drift


def test_a_published_capacity_is_the_total_without_pinning() -> None:
    status = judge(sample(free=30_000, used=0, capacity=30_512), known(used=0))
    assert not status.rejected
    assert status.gpu.total_mib == 30_512


@given(delta=st.integers(min_value=-64, max_value=64), used=st.integers(min_value=0, max_value=40_000))
def test_readings_within_the_tolerance_are_taken_as_read(delta: int, used: int) -> None:
    free = CARD - 512 - used + delta
    status = judge(sample(free=max(0, free), used=used), known(used=0))
    if free >= 0:
        assert not status.rejected
        assert status.gpu.used_mib == used


MIG = (
    MigInstance(profile="3g.20gb", instance_id=1, used_mib=12, free_mib=19_956),
    MigInstance(profile="3g.20gb", instance_id=2, used_mib=None, free_mib=None),
)


def test_a_mig_gpu_has_no_headroom_and_says_why() -> None:
    s = replace(sample(free=39_912, used=24, capacity=None), mig=MIG)
    (status,) = observe(known=[], samples=[s], reservations=[], nodes={"node-a"}, now=NOW, settings=SETTINGS)
    assert status.state is DeviceState.READY
    assert status.headroom.headroom_mib == 0
    assert status.overused_mib == 0
    assert "MIG enabled (2 GPU instances: 3g.20gb (GI 1), 3g.20gb (GI 2))" in status.message


def test_a_mig_gpu_is_never_chosen_and_the_refusal_names_mig() -> None:
    mig_gpu = replace(gpu("GPU-mig", total=CARD), mig=MIG)
    small = gpu("GPU-t4", node="node-b", total=15_360)
    settings = AllocationSettings(accounting=Accounting(safety_margin_mib=0))
    refused = choose(request(20_000), [mig_gpu, small], [], settings=settings, now=NOW)
    assert isinstance(refused, Refusal)
    verdicts = {v.gpu.uuid: v.excluded for v in refused.verdicts}
    assert verdicts["GPU-mig"] is Exclusion.MIG_ENABLED
    text = refusal_message(refused, max_sample_age_s=120, retry_hint="retried")
    assert "GPU-mig (node-a, index 0): MIG enabled (2 GPU instances: 3g.20gb (GI 1), 3g.20gb (GI 2))" in text
    chosen = choose(request(1000), [mig_gpu, small], [], settings=settings, now=NOW)
    assert isinstance(chosen, Choice)
    assert chosen.gpu.uuid == "GPU-t4"
