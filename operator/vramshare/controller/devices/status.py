"""What a GpuDevice's status says about a GPU as the domain judged it: figures, state and conditions
(pure)."""

from __future__ import annotations

from collections.abc import Sequence

from vramshare.domain.inventory import (
    DeviceState,
)
from vramshare.domain.inventory import DeviceStatus as Judged
from vramshare.kube.objects import Condition, Delivery, DeviceStatus

CONDITION_TYPES = ("Ready", "Stale", "Missing", "MemoryOverused")


def conditions(
    previous: Sequence[Condition], wanted: dict[str, tuple[bool, str, str]], now: float, generation: int = 0
) -> tuple[Condition, ...]:
    """Conditions with lastTransitionTime kept while a condition's status does not change, each with
    the generation it was judged for."""
    before = {c.type: c for c in previous}
    out = []
    for kind in CONDITION_TYPES:
        ok, reason, message = wanted[kind]
        old = before.get(kind)
        since = old.last_transition if old is not None and old.status == ok else now
        out.append(
            Condition(
                type=kind,
                status=ok,
                reason=reason,
                message=message,
                last_transition=since,
                observed_generation=generation,
            )
        )
    return tuple(out)


def device_status(
    judged: Judged,
    previous: DeviceStatus | None,
    *,
    now: float,
    generation: int = 0,
    delivery: Delivery | None = None,
) -> DeviceStatus:
    """What the GpuDevice's status should say about `judged`, for the device's `generation`;
    `delivery`: the preflight on its node (None: the last one written is kept)."""
    gpu, room, state = judged.gpu, judged.headroom, judged.state
    over = judged.overused_mib > 0
    wanted = {
        "Ready": (state is DeviceState.READY, state.value, judged.message),
        "Stale": (
            state is DeviceState.STALE,
            "SampleTooOld" if state is DeviceState.STALE else "SampleFresh",
            judged.message,
        ),
        "Missing": (
            state is DeviceState.MISSING,
            "NotReported" if state is DeviceState.MISSING else "Reported",
            judged.message,
        ),
        "MemoryOverused": (
            over,
            "UsageAboveReservations" if over else "UsageWithinReservations",
            f"{gpu.used_mib} MiB used, {room.reserved_mib} MiB reserved",
        ),
    }
    return DeviceStatus(
        total_mib=gpu.total_mib,
        used_mib=gpu.used_mib,
        free_mib=gpu.free_mib,
        driver_reserved_mib=gpu.driver_reserved_mib,
        mig=gpu.mig,
        reserved_mib=room.reserved_mib,
        headroom_mib=room.headroom_mib,
        sampled_at=gpu.sampled_at,
        last_seen_at=judged.last_seen_at,
        state=state.value,
        conditions=conditions(previous.conditions if previous else (), wanted, now, generation),
        observed_generation=generation,
        delivery=delivery if delivery is not None else (previous.delivery if previous else None),
    )


def overused(status: DeviceStatus | None) -> bool:
    condition = status.condition("MemoryOverused") if status is not None else None
    return condition is not None and condition.status
