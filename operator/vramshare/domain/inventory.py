"""The GPU inventory: what one DCGM reading plus what was known before says about every GPU.

A GPU is Ready while its latest sample is younger than the maximum age, Stale when older, and Missing
when its UUID has not been reported for a grace period *while its node's exporter still reports other
GPUs* (a card pulled or replaced), or when its node is gone. An exporter or Prometheus outage silences
a whole node: its GPUs go Stale, never Missing, so an outage cannot mark reservations Lost.

A card's total is pinned: where the exporter publishes no capacity metric, the total is free + used +
reserved, and a reading whose sum drifts from the recorded total is rejected (the GPU keeps its last
figures and ages) until the same new total has been read `repin_after_readings` times in a row (a MIG
reconfiguration, a driver that reserves differently). No timing between scrapes and queries can then
turn memory a pod grew into headroom.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from vramshare.domain.accounting import Accounting, StaleGpuMode
from vramshare.domain.headroom import Headroom, headroom
from vramshare.domain.models import Gpu, MigInstance, Reservation, mig_summary
from vramshare.domain.ownership import Ownership


class DeviceState(StrEnum):
    READY = "Ready"
    STALE = "Stale"
    MISSING = "Missing"
    NOT_SHARED = "NotShared"
    """Something else hands it out (see `vramshare.domain.ownership`): vramshare books nothing on it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """One GPU in one DCGM reading (DCGM_FI_DEV_FB_* gauges and their labels)."""

    uuid: str
    node: str
    index: int
    model: str
    free_mib: int
    used_mib: int
    driver_reserved_mib: int | None
    """None where the exporter does not publish DCGM_FI_DEV_FB_RESERVED."""
    sampled_at: float
    capacity_mib: int | None = None
    """The card's total where the exporter publishes it (DCGM_FI_DEV_FB_TOTAL or FB_CAPACITY_BYTES)."""
    mig: tuple[MigInstance, ...] = ()
    pods: tuple[tuple[str, str], ...] = ()
    """(namespace, name) of the pods DCGM attributes the GPU to (dcgm-exporter's Kubernetes mapping:
    devices a device plugin allocated), as candidates: the controller confirms each."""

    @property
    def total_mib(self) -> int:
        if self.capacity_mib is not None:
            return self.capacity_mib
        return self.free_mib + self.used_mib + (self.driver_reserved_mib or 0)

    def to_gpu(self) -> Gpu:
        total = self.total_mib
        return Gpu(
            uuid=self.uuid,
            node=self.node,
            index=self.index,
            model=self.model,
            total_mib=total,
            used_mib=self.used_mib,
            free_mib=self.free_mib,
            sampled_at=self.sampled_at,
            mig=self.mig,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TotalDrift:
    """A total, different from the pinned one, read in `readings` consecutive readings."""

    total_mib: int
    readings: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Known:
    """A GPU as the inventory recorded it before this reading."""

    gpu: Gpu
    last_seen_at: float
    drift: TotalDrift | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class InventorySettings:
    accounting: Accounting = field(default_factory=Accounting)
    missing_grace_s: float = 60.0
    """A UUID unreported this long while its node reports other GPUs is Missing."""
    forget_missing_after_s: float = 86_400.0
    """A GPU Missing and unreported this long, with nothing booked on it, is forgotten (its GpuDevice
    deleted): a card removed for good. 0: never."""
    total_drift_tolerance_mib: int = 64
    """A reading whose free + used + reserved differs from the card's pinned total by more than this is
    rejected (three MiB-rounded gauges of one scrape add up to within a few MiB of the card)."""
    repin_after_readings: int = 3
    """The same new total read this many times in a row becomes the card's total."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceStatus:
    gpu: Gpu
    last_seen_at: float
    state: DeviceState
    message: str
    headroom: Headroom
    overused_mib: int
    """Live usage beyond the active reservations plus the margin (0 when within); only for Ready GPUs."""
    drift: TotalDrift | None = None
    """A drifting total being watched (for the next reading's `Known`)."""
    rejected: str = ""
    """Why this reading's figures were not taken (the GPU keeps its previous ones); empty if taken."""


def observe(
    *,
    known: Iterable[Known],
    samples: Sequence[Sample],
    reservations: Sequence[Reservation],
    nodes: set[str] | None,
    now: float,
    settings: InventorySettings,
    ownership: Ownership | None = None,
) -> list[DeviceStatus]:
    """The status of every GPU, known or newly sampled, after this reading.

    `nodes` are the Kubernetes nodes that exist (None when unknown: then no GPU is judged gone for
    lack of a node). `ownership`: why vramshare may not share a GPU (see `vramshare.domain.ownership`).
    """
    ownership = ownership or Ownership()
    accounting = settings.accounting
    max_age = accounting.max_sample_age_s
    sampled = {s.uuid: s for s in samples}
    reporting_nodes = {s.node for s in samples if now - s.sampled_at <= max_age}
    previous = {k.gpu.uuid: k for k in known}
    # Grouped by GPU once: judging each GPU against the whole ledger cost GPUs x bookings (about 10 s
    # a poll for 1000 GPUs and 10 000 bookings).
    active: dict[str, list[Reservation]] = {}
    for r in reservations:
        if r.is_active:
            active.setdefault(r.gpu_uuid, []).append(r)
    out = []
    for uuid in sorted(set(previous) | set(sampled)):
        drift, rejected = None, ""
        if uuid in sampled:
            gpu, last_seen = sampled[uuid].to_gpu(), now
            if uuid in previous:
                gpu, drift, rejected = _pinned(sampled[uuid], previous[uuid], settings)
        else:
            gpu, last_seen = previous[uuid].gpu, previous[uuid].last_seen_at
        age = now - gpu.sampled_at
        if nodes is not None and gpu.node not in nodes:
            state, message = DeviceState.MISSING, f"node {gpu.node} no longer exists"
        elif (
            uuid not in sampled
            and gpu.node in reporting_nodes
            and now - last_seen >= settings.missing_grace_s
        ):
            state = DeviceState.MISSING
            message = (
                f"not reported for {now - last_seen:.0f} s while node {gpu.node} reports other GPUs "
                "(removed or replaced)"
            )
        elif age > max_age:
            state = DeviceState.STALE
            message = f"latest sample is {age:.0f} s old (max {max_age:g} s)"
        else:
            state, message = DeviceState.READY, "fresh DCGM sample"
        why_not = ownership.reason(node=gpu.node, uuid=uuid)
        if state is not DeviceState.MISSING and why_not:
            state, message = DeviceState.NOT_SHARED, why_not
        reason = why_not if state is DeviceState.NOT_SHARED else ""
        if gpu.not_shared != reason:  # a copy only when it changes: this runs for every GPU every poll
            gpu = replace(gpu, not_shared=reason)
        if rejected and state is not DeviceState.MISSING:
            message = f"{message}; {rejected}"
        if gpu.mig_enabled and state is not DeviceState.MISSING:
            message = f"{message}; MIG enabled ({mig_summary(gpu.mig)}): not handed to pods"
        gpu = replace(gpu, missing=state is DeviceState.MISSING)
        on_gpu = active.get(gpu.uuid, [])
        room = headroom(
            gpu,
            on_gpu,
            settle_s=accounting.settle_s,
            safety_margin_mib=accounting.safety_margin_mib,
            ledger_only=state is DeviceState.STALE and accounting.stale_mode is StaleGpuMode.LEDGER_ONLY,
        )
        if state in (DeviceState.MISSING, DeviceState.NOT_SHARED) or gpu.mig_enabled:
            room = replace(room, headroom_mib=0)
        overused = 0
        if state is DeviceState.READY and not gpu.mig_enabled:
            # A hold books memory for a task that is not running: it allows no usage.
            held = sum(r.mib for r in on_gpu if r.held_for)
            overused = max(0, gpu.used_mib - (room.reserved_mib - held) - accounting.safety_margin_mib)
        out.append(
            DeviceStatus(
                gpu=gpu,
                last_seen_at=last_seen,
                state=state,
                message=message,
                headroom=room,
                overused_mib=overused,
                drift=drift,
                rejected=rejected,
            )
        )
    return out


def _pinned(sample: Sample, known: Known, settings: InventorySettings) -> tuple[Gpu, TotalDrift | None, str]:
    """The GPU this sample describes, held to the card's pinned total: (gpu, drift being watched, why
    the sample was rejected or "")."""
    fresh = sample.to_gpu()
    pinned = known.gpu.total_mib
    tolerance = settings.total_drift_tolerance_mib
    # A published capacity is the card's own word; a MIG GPU's figures are its instances' sums, which
    # change with the instances (and it is never handed out).
    if sample.capacity_mib is not None or fresh.mig_enabled or known.gpu.mig_enabled or pinned <= 0:
        return fresh, None, ""
    if abs(fresh.total_mib - pinned) <= tolerance:
        return fresh, None, ""
    before = known.drift
    same = before is not None and abs(before.total_mib - fresh.total_mib) <= tolerance
    readings = (before.readings if before is not None and same else 0) + 1
    if readings >= settings.repin_after_readings:
        return fresh, None, ""
    why = (
        f"reading rejected: free + used + reserved = {fresh.total_mib} MiB, but the card's total is "
        f"{pinned} MiB (read {readings} time(s) in a row; taken as the new total after "
        f"{settings.repin_after_readings})"
    )
    return known.gpu, TotalDrift(total_mib=fresh.total_mib, readings=readings), why


def to_forget(
    statuses: Iterable[DeviceStatus],
    *,
    reservations: Iterable[Reservation],
    now: float,
    settings: InventorySettings,
) -> list[DeviceStatus]:
    """The Missing GPUs unreported for `forget_missing_after_s` that no active reservation books (a
    Lost booking keeps its GPU known until its pod ends)."""
    if settings.forget_missing_after_s <= 0:
        return []
    booked = {r.gpu_uuid for r in reservations if r.is_active}
    return [
        s
        for s in statuses
        if s.state is DeviceState.MISSING
        and now - s.last_seen_at >= settings.forget_missing_after_s
        and s.gpu.uuid not in booked
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuPresence:
    """Which GPUs the last inventory found gone, as the reservation lifecycle needs it."""

    missing: frozenset[str] = frozenset()
    known: frozenset[str] | None = None
    """Every GPU the inventory knows; None until it has run once."""

    def is_missing(self, uuid: str) -> bool:
        """Missing, or unknown to an inventory that has run (its GpuDevice was deleted by hand)."""
        return uuid in self.missing or (self.known is not None and uuid not in self.known)

    @classmethod
    def of(cls, statuses: Iterable[DeviceStatus]) -> GpuPresence:
        listed = list(statuses)
        return cls(
            missing=frozenset(s.gpu.uuid for s in listed if s.state is DeviceState.MISSING),
            known=frozenset(s.gpu.uuid for s in listed),
        )


def heartbeat_candidates(statuses: Iterable[DeviceStatus], *, window_s: float) -> dict[str, float]:
    """The GPUs a poll's heartbeat may confirm, with each one's sample time: Ready, its reading taken,
    and sampled at most `window_s` before the newest such sample (see
    `vramshare.domain.freshness.compose_heartbeat`)."""
    ready = {
        s.gpu.uuid: s.gpu.sampled_at for s in statuses if s.state is DeviceState.READY and not s.rejected
    }
    if not ready:
        return {}
    newest = max(ready.values())
    return {uuid: at for uuid, at in ready.items() if at >= newest - window_s}
