"""Refuse mode, made fair: a bounded hold of freed memory for a refused large request, and a
Retry-After from when memory is expected to free.

In refuse mode a refused task comes back only at its next try. Memory that frees meanwhile goes to
whoever asks first, so a stream of small tasks can keep a large one out for good. A refused request of
at least `hold_min_mib` therefore gets a *hold*: a booking of its size on the GPU closest to fitting
it (one hold per GPU), kept for `hold_limit_s` at most. The hold counts against that GPU for everyone
else, so the memory that frees there collects for the task; its next try is credited the hold and
admitted as soon as the GPU has room. The hold is identified by the task's key (the same Airflow task
across tries), not by the pod, whose name changes with every try.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from vramshare.domain.allocation import AllocationSettings, GpuVerdict, Refusal
from vramshare.domain.headroom import headroom_of
from vramshare.domain.models import Gpu


@dataclass(frozen=True, slots=True, kw_only=True)
class FairnessSettings:
    hold_min_mib: int = 10_240
    """Refused requests of at least this many MiB get a hold; 0 turns holds off."""
    hold_limit_s: float = 900.0
    """How long a hold (and, in queue mode, the head's hold on one GPU) lasts at most."""


def could_ever_fit(mib: int, gpu: Gpu, *, settings: AllocationSettings) -> bool:
    """Whether `gpu`, empty, would have room for `mib`."""
    empty = headroom_of(
        gpu,
        reserved_mib=0,
        unseen_mib=0,
        safety_margin_mib=settings.accounting.safety_margin_mib,
        ledger_only=True,
    )
    return (
        not gpu.missing
        and gpu.healthy
        and not gpu.mig_enabled
        and not gpu.not_shared
        and empty.headroom_mib >= mib
    )


def closest_to_fitting(
    mib: int,
    verdicts: Iterable[GpuVerdict],
    *,
    settings: AllocationSettings,
    nodes: frozenset[str] | None = None,
    exclude: Collection[str] = (),
) -> Gpu | None:
    """The GPU that could take `mib` once enough frees up and now has the most headroom (ties by node,
    index, UUID); None when no GPU big enough is usable."""
    rooms = [
        (v.headroom.headroom_mib, v.gpu)
        for v in verdicts
        if v.headroom is not None
        and v.gpu.uuid not in exclude
        and (nodes is None or v.gpu.node in nodes)
        and could_ever_fit(mib, v.gpu, settings=settings)
    ]
    if not rooms:
        return None
    return min(rooms, key=lambda t: (-t[0], t[1].node, t[1].index, t[1].uuid))[1]


def gpu_to_hold(
    refusal: Refusal,
    *,
    held: Collection[str],
    settings: AllocationSettings,
    fairness: FairnessSettings,
) -> Gpu | None:
    """Where to keep memory for a refused request: None when it is too small to need it, or every GPU
    that could take it already holds memory for another task."""
    mib = refusal.request.mib
    if fairness.hold_min_mib <= 0 or mib < fairness.hold_min_mib:
        return None
    return closest_to_fitting(
        mib, refusal.verdicts, settings=settings, nodes=refusal.request.nodes, exclude=held
    )


class ReleaseLog:
    """Memory released lately, per GPU, to estimate when a refused request may fit: times are handed
    in by the caller."""

    def __init__(self, *, window_s: float = 600.0) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, str, int]] = deque()

    def add(self, *, at: float, gpu_uuid: str, mib: int) -> None:
        self._events.append((at, gpu_uuid, mib))
        self._trim(at)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()

    def rate_mib_per_s(self, *, now: float, gpu_uuid: str | None = None) -> float:
        """MiB released per second over the window, on one GPU or (None) on all."""
        self._trim(now)
        released = sum(mib for _, g, mib in self._events if gpu_uuid is None or g == gpu_uuid)
        return released / self.window_s


def missing_mib(refusal: Refusal) -> int:
    """How much more memory the refused request needs than the most any GPU can give it now."""
    return refusal.request.mib - max(refusal.best_headroom_mib or 0, 0)


def retry_after_s(*, deficit_mib: int, rate_mib_per_s: float, floor_s: int, ceiling_s: int) -> int:
    """When to try again: the time the observed release rate takes to free `deficit_mib`, within
    [floor_s, ceiling_s] (the ceiling when nothing was released lately)."""
    if deficit_mib <= 0:
        return floor_s
    seconds = deficit_mib / rate_mib_per_s if rate_mib_per_s > 0 else math.inf
    if seconds >= ceiling_s:  # also when nothing was released lately
        return ceiling_s
    return max(floor_s, math.ceil(seconds))
