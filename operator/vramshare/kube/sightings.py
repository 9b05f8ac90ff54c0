"""What the reservation lifecycle needs of a pod that carries a reservation's label (`PodSighting`),
read from the pod as the API server sends it: the controller plans each booking's lifecycle from it, and
the webhooks count a booking from its pod's start with it (`vramshare.domain.with_its_pod`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from vramshare.domain import PodSighting, PodState
from vramshare.kube.client import Obj
from vramshare.kube.resources import ANNOTATION_GPU_UUID, LABEL_RESERVATION, parse_time

DEFAULT_GRACE_S = 30.0
"""A pod's terminationGracePeriodSeconds when its spec does not say (the API server's default)."""
KUBELET_KILL_S = 2.0
"""What the kubelet takes past the grace period to kill and reap the containers (its minimum grace)."""


def pod_sighting(pod: Obj) -> PodSighting:
    """What the lifecycle needs of a pod carrying a reservation's label."""
    meta, status = pod["metadata"], pod.get("status") or {}
    starts = []
    for c in status.get("containerStatuses") or []:
        state = c.get("state") or {}
        started = (state.get("running") or state.get("terminated") or {}).get("startedAt")
        if started:
            starts.append(parse_time(started))
    phase = str(status.get("phase") or "Pending")
    scheduled: Obj = next((c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"), {})
    unschedulable = scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable"
    finished = phase in ("Succeeded", "Failed")
    # A container the runtime runs (it has an ID) that has not stopped: should the pod object go now, the
    # kubelet has yet to kill it. A graceful delete removes the object only once every container stopped.
    runs = any(
        c.get("containerID") and "running" in (c.get("state") or {})
        for c in status.get("containerStatuses") or []
    )
    grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds")
    grace_s = float(grace) if isinstance(grace, int | float) else DEFAULT_GRACE_S
    return PodSighting(
        forced_grace_s=grace_s if runs and not finished else None,
        unschedulable_since=parse_time(scheduled.get("lastTransitionTime")) or 0.0 if unschedulable else None,
        unschedulable_message=str(scheduled.get("message") or "") if unschedulable else "",
        name=meta["name"],
        uid=meta["uid"],
        created_at=parse_time(meta.get("creationTimestamp")) or 0.0,
        state=PodState.FINISHED if finished else PodState.ACTIVE,
        running_since=min((s for s in starts if s is not None), default=None),
        gpu_uuid=(meta.get("annotations") or {}).get(ANNOTATION_GPU_UUID),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class LabelledPod:
    """A pod carrying vramshare's reservation label, as the webhooks' pod watch keeps it."""

    namespace: str
    label: str
    """Its vramshare.io/reservation label: the `pod_label` of the bookings made for it."""
    sighting: PodSighting

    @classmethod
    def from_wire(cls, pod: Obj) -> LabelledPod:
        meta = pod["metadata"]
        return cls(
            namespace=str(meta.get("namespace") or ""),
            label=str((meta.get("labels") or {}).get(LABEL_RESERVATION) or ""),
            sighting=pod_sighting(pod),
        )


class PodsByLabel:
    """The pods carrying vramshare's reservation label, as sightings by (namespace, label), kept in step
    with a pod watch's changes (`changed`); listeners hear which label's pods changed."""

    def __init__(self) -> None:
        self._pods: dict[str, LabelledPod] = {}
        self._by_label: dict[tuple[str, str], dict[str, PodSighting]] = {}
        self._listeners: list[Callable[[tuple[str, str]], None]] = []

    @classmethod
    def of_pods(cls, pods: Iterable[Obj]) -> PodsByLabel:
        """From pods as listed (those without a UID, not created yet, left out)."""
        grouped = cls()
        for pod in pods:
            meta = pod["metadata"]
            if meta.get("uid"):
                grouped.changed(f"{meta.get('namespace', '')}/{meta['name']}", LabelledPod.from_wire(pod))
        return grouped

    def on_change(self, listener: Callable[[tuple[str, str]], None]) -> None:
        self._listeners.append(listener)

    def of(self, namespace: str, label: str) -> Iterable[PodSighting]:
        """The pods carrying `label` in `namespace` (empty when none)."""
        pods = self._by_label.get((namespace, label))
        return pods.values() if pods else ()

    def changed(self, key: str, pod: LabelledPod | None) -> None:
        """The pod at `key` (namespace/name) is now `pod` (None: gone, or no longer labelled). Listeners
        hear of it only when its sighting changed: most of a pod's events (its binding to the node,
        conditions, a deletion starting) change nothing a sighting holds, and every listener would
        count its label's bookings again for nothing (issue #45)."""
        if pod is not None and self._pods.get(key) == pod:
            return
        before = self._pods.pop(key, None)
        if before is not None:
            label = (before.namespace, before.label)
            pods = self._by_label.get(label)
            if pods is not None:
                pods.pop(key, None)
                if not pods:
                    del self._by_label[label]
            if pod is None or (pod.namespace, pod.label) != label:
                self._tell(label)
        if pod is not None:
            self._pods[key] = pod
            label = (pod.namespace, pod.label)
            self._by_label.setdefault(label, {})[key] = pod.sighting
            self._tell(label)

    def _tell(self, label: tuple[str, str]) -> None:
        for listener in self._listeners:
            listener(label)
