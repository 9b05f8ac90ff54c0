"""The nouns of vramshare: GPUs as DCGM last saw them, reservations, and what a pod asks for.

Everything here is an immutable value. Times are Unix seconds (floats) handed in by the caller, so the
domain never reads a clock and every decision can be replayed.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum


class ReservationPhase(StrEnum):
    """Where a reservation is in its life; see `vramshare.domain.lifecycle`."""

    QUEUED = "Queued"  # its pod waits (behind a scheduling gate) for a GPU with room; nothing booked yet
    RESERVED = "Reserved"  # the webhook committed it; its pod may not exist yet
    BOUND = "Bound"  # its pod exists
    RELEASED = "Released"  # its pod finished or was deleted
    EXPIRED = "Expired"  # no pod appeared within the TTL
    LOST = "Lost"  # its GPU is missing from the inventory while its pod still runs: still booked
    HELD = "Held"  # memory kept on one GPU for a refused large request's next try (no pod)
    GRANTED = "Granted"  # room one webhook replica books its pods in (no pod; see domain.grants)

    @property
    def is_active(self) -> bool:
        """An active reservation holds memory on its GPU."""
        return self in (
            ReservationPhase.RESERVED,
            ReservationPhase.BOUND,
            ReservationPhase.LOST,
            ReservationPhase.HELD,
            ReservationPhase.GRANTED,
        )

    @property
    def is_open(self) -> bool:
        """Not ended: waiting in the queue or holding memory."""
        return self is ReservationPhase.QUEUED or self.is_active


@dataclass(frozen=True, slots=True, kw_only=True)
class MigInstance:
    """One GPU instance of a MIG-enabled GPU, as dcgm-exporter labels it (`GPU_I_PROFILE`, `GPU_I_ID`).

    DCGM labels an instance with its parent's UUID only: the MIG device UUID a container would need is
    not in the series, so vramshare cannot hand an instance to a pod (see `Gpu.mig`)."""

    profile: str
    """e.g. "3g.20gb"."""
    instance_id: int
    used_mib: int | None
    free_mib: int | None
    """None where the exporter publishes no framebuffer figures for instances (some H100 set-ups)."""

    @property
    def label(self) -> str:
        return f"{self.profile} (GI {self.instance_id})"


def mig_summary(instances: tuple[MigInstance, ...]) -> str:
    """How people are shown a MIG GPU, e.g. "2 GPU instances: 3g.20gb (GI 1), 3g.20gb (GI 2)"."""
    return f"{len(instances)} GPU instances: {', '.join(i.label for i in instances)}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Gpu:
    """One physical GPU as the inventory knows it.

    `total_mib` is the card's framebuffer: the exporter's capacity metric where it publishes one, else
    `free_mib + used_mib + driver_reserved_mib` of one scrape, pinned per card by the inventory (a
    reading that drifts from it is rejected). FB_RESERVED (memory the driver keeps for itself) is
    missing on some exporter versions, in which case it is 0.
    """

    uuid: str
    node: str
    index: int
    model: str
    total_mib: int
    used_mib: int
    free_mib: int
    sampled_at: float
    """When DCGM took the sample (the sample's own timestamp, not when we read it)."""
    healthy: bool = True
    missing: bool = False
    """The UUID has not been reported for a grace period (card removed or replaced, node gone)."""
    mig: tuple[MigInstance, ...] = ()
    """The GPU instances of a MIG-enabled GPU; empty for a whole GPU. A MIG-enabled GPU is never
    handed to a pod: its UUID names the parent, which a container cannot use while MIG is on."""
    not_shared: str = ""
    """Why vramshare may not share it: something else hands it out (NVIDIA's device plugin on its node,
    see `vramshare.domain.ownership`); empty when it may."""

    @property
    def mig_enabled(self) -> bool:
        return bool(self.mig)

    @property
    def driver_reserved_mib(self) -> int:
        return max(0, self.total_mib - self.used_mib - self.free_mib)

    @property
    def label(self) -> str:
        """How messages name a GPU: its UUID with node and index, which people recognise."""
        return f"{self.uuid} ({self.node}, index {self.index})"


@dataclass(frozen=True, slots=True, kw_only=True)
class Reservation:
    """Memory booked on one GPU for one pod: the ledger entry behind a GpuReservation object."""

    name: str
    namespace: str
    pod: str
    """The pod's name, or its generateName prefix followed by '*' until the controller binds it."""
    mib: int
    node: str
    gpu_uuid: str
    """Empty while Queued: no GPU chosen yet."""
    gpu_index: int
    phase: ReservationPhase
    reserved_at: float
    pod_running_since: float | None = None
    """When its pod's containers started; None while the pod has not run."""
    finished_at: float | None = None
    held_for: str = ""
    """For a hold (phase Held): the key of the task it is kept for (see `vramshare.domain.fairness`)."""
    user: str = ""
    """Who created the pod it was admitted for (the admission request's user)."""
    pod_label: str = ""
    """The value of its pod's label vramshare.io/reservation: its name, or its set's (several GPUs)."""
    queue_entry: bool = False
    """Made for a pod that waited in the queue: its pod exists (behind a gate) from the start, so it is
    never pending (see `vramshare.domain.tenancy`)."""
    pod_seen: bool = False
    """The controller has seen its pod (and recorded it in the reservation's status)."""
    grant: str = ""
    """For a booking made inside a grant (`vramshare.domain.grants`): the grant's key, namespace/name."""
    acknowledged: bool = False
    """For a grant: the controller recorded it Granted, so it knows grants and ends this one only when
    it lapses (an older controller would end it as a booking whose pod never came)."""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def is_active(self) -> bool:
        return self.phase.is_active


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocationRequest:
    """What a pod asks for at admission."""

    mib: int
    namespace: str
    pod: str
    """The pod's name (or generateName prefix) for messages."""
    nodes: frozenset[str] | None = None
    """Set when the pod can only go to some nodes: only their GPUs are candidates."""
    node_reasons: Mapping[str, str] = field(default_factory=dict)
    """Why the pod cannot go to each other node (for messages; see `vramshare.domain.scheduling`)."""
    model: str | None = None
    """Only GPUs whose model (as DCGM reports it) matches this: exact, or a pattern with * and ?."""
    count: int = 1
    """How many GPUs, all on one node, each with `mib` of headroom (a distributed training task)."""


def model_matches(pattern: str | None, model: str) -> bool:
    """Whether a GPU model matches a `gpu-model` request (None: any); `*` and `?` are wildcards."""
    return pattern is None or fnmatch.fnmatchcase(model, pattern)
