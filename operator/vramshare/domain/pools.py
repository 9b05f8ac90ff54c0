"""How many slots an Airflow pool of GPU tasks should have, from the GPU inventory.

Kaapana keeps an Airflow pool (NODE_GPU_COUNT) whose slots follow the number of usable GPUs, so
Airflow never queues more GPU tasks than the fleet can take; vramshare's controller keeps such a pool
in step. The pool is the coarse gate (how many GPU tasks run at once); the webhook stays the exact one
(how much memory each gets).

Slots count capacity, not the headroom of the moment: a running task already holds its pool slot, so
counting what it uses as well would shrink the pool twice for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from vramshare.domain.inventory import DeviceState, DeviceStatus


class PoolBasis(StrEnum):
    READY_GPUS = "ready-gpus"
    """One slot per Ready GPU (Kaapana's NODE_GPU_COUNT)."""
    MEMORY = "memory"
    """Per Ready GPU, as many slots as tasks of the typical size fit in what applications can have
    of its memory (less the driver's reserve and the safety margin)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolRule:
    basis: PoolBasis = PoolBasis.READY_GPUS
    task_mib: int = 8192
    """The memory basis: the typical GPU task's request, in MiB."""
    safety_margin_mib: int = 0
    """The memory basis: kept free on every GPU (the accounting's margin)."""
    minimum: int = 0
    """Never fewer slots than this (e.g. 1, so one task can still try while DCGM is away)."""


def pool_slots(devices: Iterable[DeviceStatus], *, rule: PoolRule) -> int:
    """The pool's slots for the GPUs as the inventory judged them: only Ready GPUs count (a Stale or
    Missing GPU takes no new pods)."""
    ready = [d.gpu for d in devices if d.state is DeviceState.READY]
    if rule.basis is PoolBasis.MEMORY:
        # What applications can ever have: not the driver's own reserve, not the margin.
        slots = sum(
            max(0, g.total_mib - g.driver_reserved_mib - rule.safety_margin_mib) // rule.task_mib
            for g in ready
        )
    else:
        slots = len(ready)
    return max(slots, rule.minimum)
