"""Hypothesis strategies for the domain's property tests: GPUs, bookings, fleets, settings, requests."""

from __future__ import annotations

from hypothesis import strategies as st

from tests.unit.domain.builders import NOW
from vramshare.domain import (
    Accounting,
    AllocationRequest,
    AllocationSettings,
    Gpu,
    Policy,
    Reservation,
    ReservationPhase,
    StaleGpuMode,
)

UUIDS = [f"GPU-{i}" for i in range(6)]


@st.composite
def gpus(draw: st.DrawFn) -> Gpu:
    total = draw(st.integers(1_024, 200_000))
    used = draw(st.integers(0, total))
    driver = draw(st.integers(0, total - used))
    return Gpu(
        uuid=draw(st.sampled_from(UUIDS)),
        node=draw(st.sampled_from(["node-a", "node-b"])),
        index=draw(st.integers(0, 7)),
        model="fake",
        total_mib=total,
        used_mib=used,
        free_mib=total - used - driver,
        sampled_at=NOW - draw(st.floats(0, 600)),
        healthy=draw(st.booleans()) or draw(st.booleans()),
        missing=draw(st.integers(0, 9)) == 0,
    )


@st.composite
def reservations(draw: st.DrawFn) -> Reservation:
    started = draw(st.none() | st.floats(NOW - 1_000, NOW))
    phase = draw(st.sampled_from(list(ReservationPhase)))
    return Reservation(
        # A few names are shared, so that bookings name grants that are there (`grant`).
        name=f"r-{draw(st.integers(0, 3) | st.integers(0, 10**6))}",
        namespace="ns",
        pod="p",
        mib=draw(st.integers(1, 60_000)),
        node="node-a",
        gpu_uuid=draw(st.sampled_from(UUIDS)),
        gpu_index=0,
        phase=phase,
        reserved_at=NOW - 1_000,
        pod_running_since=None if phase is ReservationPhase.GRANTED else started,
        grant=""
        if phase is ReservationPhase.GRANTED
        else draw(st.sampled_from(["", "", "ns/r-0", "ns/r-1"])),
    )


def fleet() -> st.SearchStrategy[list[Gpu]]:
    return st.lists(gpus(), max_size=6, unique_by=lambda g: g.uuid)


allocation_settings = st.builds(
    AllocationSettings,
    policy=st.sampled_from(list(Policy)),
    accounting=st.builds(
        Accounting,
        safety_margin_mib=st.integers(0, 2_048),
        settle_s=st.floats(0, 300),
        max_sample_age_s=st.floats(1, 600),
        stale_mode=st.sampled_from(list(StaleGpuMode)),
    ),
)


requests = st.builds(
    AllocationRequest,
    mib=st.integers(1, 100_000),
    namespace=st.just("ns"),
    pod=st.just("p"),
    nodes=st.none() | st.frozensets(st.sampled_from(["node-a", "node-b", "node-c"]), max_size=2),
)


def booked_by_definition(gpu: Gpu, ledger: list[Reservation]) -> int:
    """R_all as `vramshare.domain.grants` defines it, written out apart from the code under test: every
    active booking, and of every active grant what the bookings inside it do not use."""
    on = [r for r in ledger if r.is_active and r.gpu_uuid == gpu.uuid]
    grants = {f"{r.namespace}/{r.name}" for r in on if r.phase is ReservationPhase.GRANTED}
    pods = sum(r.mib for r in on if r.phase is not ReservationPhase.GRANTED)
    left = 0
    for key in grants:
        granted = sum(
            r.mib for r in on if r.phase is ReservationPhase.GRANTED and f"{r.namespace}/{r.name}" == key
        )
        inside = sum(r.mib for r in on if r.phase is not ReservationPhase.GRANTED and r.grant == key)
        left += max(0, granted - inside)
    return pods + left
