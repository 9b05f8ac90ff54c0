"""Hold what you share (issue #43; KAI Scheduler's reservation pods): on a node where NVIDIA's device
plugin hands GPUs out whole, vramshare shares only the GPUs it holds through that plugin. A holder is a
pod in vramshare's namespace requesting `nvidia.com/gpu: 1`; once it runs, it reads through NVML which
GPU it was given and writes the UUID on itself. While it runs, the plugin gives that GPU to no one else
and the scheduler, quotas and `kubectl describe node` count it.

Holds follow demand: each node keeps `min_idle_per_node` held GPUs with nothing booked on them (a task
that fits no held GPU fits an idle one), so a booking on the last idle one acquires another, up to
`max_per_node` and `max_total`; an idle held GPU beyond that minimum is given back after
`idle_release_s`. Pure: what the controller saw in, what to create and delete out.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field
from enum import StrEnum


class HolderState(StrEnum):
    ACQUIRING = "Acquiring"
    """Created, not yet running with its GPU's UUID written (scheduling, starting, or no GPU free)."""
    HOLDING = "Holding"
    RELEASING = "Releasing"
    """Asked to give its GPU back: the GPU is out of sharing first (no booking can land on it), and the
    holder is deleted once it is, with nothing booked."""
    LEAVING = "Leaving"
    """Being deleted or ended: its GPU is no longer vramshare's."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Holder:
    name: str
    node: str
    """The node it was made for (its label; the pod's nodeName once scheduled must agree)."""
    gpu_uuid: str = ""
    """What NVML in its container said, once it has said it."""
    state: HolderState = HolderState.ACQUIRING
    created_at: float = 0.0
    release_requested_at: float = 0.0
    """When the controller asked it to give its GPU back (state Releasing)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HoldSettings:
    min_idle_per_node: int = 1
    """Held GPUs with nothing booked kept on each node ("warm"); a booking on the last one acquires
    another."""
    max_per_node: int = 0
    """At most this many holders per node (0: as many GPUs as the node's plugin advertises)."""
    max_total: int = 0
    """At most this many holders in the cluster (0: no limit)."""
    idle_release_s: float = 300.0
    """An idle held GPU beyond the warm minimum is given back after this long with nothing booked."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HoldNode:
    """A node whose GPUs vramshare may hold: NVIDIA's device plugin advertises them, each whole."""

    name: str
    advertised: int
    """`nvidia.com/gpu` in its allocatable."""
    schedulable: bool = True
    """False while cordoned or draining: no new holders there."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HoldPlan:
    acquire: Mapping[str, int] = field(default_factory=dict)
    """Node -> how many holders to create there."""
    release: tuple[str, ...] = ()
    """Holders to ask to give their GPU back: idle beyond the warm minimum for idle_release_s."""
    give_back: tuple[str, ...] = ()
    """Releasing holders to delete: their GPU is out of sharing where the webhook reads it and has had
    nothing booked for `RELEASE_SETTLE_S` since."""
    keep: tuple[str, ...] = ()
    """Releasing holders whose GPU got a booking before it left sharing: they hold on."""


RELEASE_SETTLE_S = 3.0
"""How long a released GPU stays out of sharing, with nothing booked, before its holder goes: a commit
that landed just before it left sharing reaches the controller's view well within it."""


def held(holders: Iterable[Holder]) -> dict[str, Holder]:
    """UUID -> the holder holding it (running with its UUID written)."""
    return {h.gpu_uuid: h for h in holders if h.state is HolderState.HOLDING and h.gpu_uuid}


def plan_holds(
    *,
    nodes: Iterable[HoldNode],
    holders: Iterable[Holder],
    booked: Set[str],
    idle_since: Mapping[str, float],
    now: float,
    settings: HoldSettings,
    out_of_sharing: Set[str] = frozenset(),
) -> HoldPlan:
    """What to create and delete so each node keeps `min_idle_per_node` idle held GPUs. `booked`: the
    UUIDs with an active booking; `idle_since`: UUID -> when it was last seen booked (or held);
    `out_of_sharing`: the GPUs whose stored state the webhook reads says not shared."""
    by_node: dict[str, list[Holder]] = defaultdict(list)
    live = [h for h in holders if h.state is not HolderState.LEAVING]
    for holder in live:
        by_node[holder.node].append(holder)
    total = len(live)
    acquire: dict[str, int] = {}
    release: list[str] = []
    for node in sorted(nodes, key=lambda n: n.name):
        mine = by_node.get(node.name, [])
        acquiring = [h for h in mine if h.state is HolderState.ACQUIRING]
        idle = [h for h in mine if h.state is HolderState.HOLDING and h.gpu_uuid not in booked]
        cap = node.advertised if settings.max_per_node <= 0 else min(node.advertised, settings.max_per_node)
        missing = settings.min_idle_per_node - len(idle) - len(acquiring)
        if missing > 0 and node.schedulable:
            room = cap - len(mine)
            if settings.max_total > 0:
                room = min(room, settings.max_total - total)
            if room > 0:
                acquire[node.name] = min(missing, room)
                total += acquire[node.name]
        surplus = len(idle) - max(settings.min_idle_per_node, 0)
        if surplus > 0:
            # The longest idle first; none before its idle_release_s.
            longest = sorted(idle, key=lambda h: (idle_since.get(h.gpu_uuid, now), h.name))
            release += [
                h.name
                for h in longest[:surplus]
                if now - idle_since.get(h.gpu_uuid, now) >= settings.idle_release_s
            ]
    releasing = [h for h in live if h.state is HolderState.RELEASING]
    keep = tuple(h.name for h in releasing if h.gpu_uuid in booked)
    give_back = tuple(
        h.name
        for h in releasing
        if h.gpu_uuid not in booked
        and h.gpu_uuid in out_of_sharing
        and now - h.release_requested_at >= RELEASE_SETTLE_S
    )
    return HoldPlan(acquire=acquire, release=tuple(release), give_back=give_back, keep=keep)


def lost(before: Mapping[str, Holder], after: Mapping[str, Holder], booked: Set[str]) -> list[Holder]:
    """Holders that held a GPU with bookings on it and hold it no more (deleted, evicted, preempted, or
    their node drained): those bookings' GPU may now be handed out whole by the device plugin."""
    return [h for uuid, h in before.items() if uuid not in after and uuid in booked]
