"""The Airflow pool's slots from the inventory (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tests.unit.domain.builders import judged
from vramshare.domain.inventory import DeviceState
from vramshare.domain.pools import PoolBasis, PoolRule, pool_slots


def test_one_slot_per_ready_gpu_by_default() -> None:
    devices = [
        judged(DeviceState.READY, uuid="a"),
        judged(DeviceState.READY, uuid="b"),
        judged(DeviceState.STALE, uuid="c"),
        judged(DeviceState.MISSING, uuid="d"),
    ]
    assert pool_slots(devices, rule=PoolRule()) == 2
    assert pool_slots([], rule=PoolRule()) == 0
    assert pool_slots([], rule=PoolRule(minimum=1)) == 1


def test_the_memory_basis_counts_tasks_of_the_typical_size_in_each_gpus_capacity() -> None:
    rule = PoolRule(basis=PoolBasis.MEMORY, task_mib=8192, safety_margin_mib=512)
    # 40960 - 512 = 40448 -> 4 tasks; 16384 - 512 -> 1 task; what is used now does not count.
    devices = [
        judged(DeviceState.READY, total=40_960, used=30_000, uuid="a"),
        judged(DeviceState.READY, total=16_384, uuid="b"),
        judged(DeviceState.STALE, total=81_920, uuid="c"),
    ]
    assert pool_slots(devices, rule=rule) == 5


@given(
    st.lists(
        st.tuples(st.sampled_from(list(DeviceState)), st.integers(min_value=1, max_value=200_000)),
        max_size=40,
    ),
    st.integers(min_value=1, max_value=100_000),
    st.integers(min_value=0, max_value=4_000),
    st.integers(min_value=0, max_value=8),
)
def test_slots_follow_only_ready_gpus_and_never_fall_below_the_minimum(
    fleet: list[tuple[DeviceState, int]], task_mib: int, margin: int, minimum: int
) -> None:
    devices = [judged(state, total=total, uuid=f"GPU-{i}") for i, (state, total) in enumerate(fleet)]
    ready = [d for d in devices if d.state is DeviceState.READY]
    for basis in PoolBasis:
        rule = PoolRule(basis=basis, task_mib=task_mib, safety_margin_mib=margin, minimum=minimum)
        slots = pool_slots(devices, rule=rule)
        assert slots >= minimum
        # Stale and Missing GPUs change nothing.
        assert slots == pool_slots(ready, rule=rule)
        if basis is PoolBasis.READY_GPUS:
            assert slots == max(len(ready), minimum)
        else:
            # Each counted task really fits in its GPU beside the margin.
            exact = sum((d.gpu.total_mib - margin) // task_mib for d in ready if d.gpu.total_mib > margin)
            assert slots == max(exact, minimum)
