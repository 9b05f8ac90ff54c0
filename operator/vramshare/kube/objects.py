"""GpuDevice and GpuReservation as typed values, with their one conversion from and to the wire.

Every reader of vramshare's custom resources (the webhook's ledger, the controller, `vramshare status`)
decodes them here, so a field's spelling and its default live in one place. Times are Unix seconds.
Decoding is lenient where the API server's schema already guarantees a shape, and defaults what an
older object may lack (a reservation without status is Reserved: the webhook cannot write status on
create).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Self

from vramshare.domain import Gpu, Reservation, ReservationPhase
from vramshare.domain.delivery_judgement import Check, Result
from vramshare.domain.inventory import DeviceState
from vramshare.domain.models import MigInstance, mig_summary
from vramshare.kube.resources import (
    API_VERSION,
    FINALIZER_POD_GONE,
    LABEL_ACTIVE,
    LABEL_COMMITTED,
    LABEL_GPU,
    LABEL_HELD_FOR,
    LABEL_QUEUED,
    LABEL_SET,
    device_name,
    format_time,
    format_time_precise,
    parse_time,
)

Obj = dict[str, Any]


def _put(out: Obj, key: str, value: object) -> None:
    if value is not None:
        out[key] = value


@dataclass(frozen=True, kw_only=True)
class OwnerRef:
    api_version: str
    kind: str
    name: str
    uid: str

    @classmethod
    def from_wire(cls, obj: Obj) -> Self:
        return cls(
            api_version=str(obj.get("apiVersion", "")),
            kind=str(obj.get("kind", "")),
            name=str(obj.get("name", "")),
            uid=str(obj.get("uid", "")),
        )

    def to_wire(self) -> Obj:
        return {"apiVersion": self.api_version, "kind": self.kind, "name": self.name, "uid": self.uid}


@dataclass(frozen=True, kw_only=True)
class Meta:
    """The metadata vramshare reads and writes."""

    name: str
    namespace: str | None = None
    uid: str = ""
    resource_version: str = ""
    generation: int = 0
    """Bumped by the API server on every spec change; status reports the one it describes."""
    created_at: float | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    owners: tuple[OwnerRef, ...] = ()
    finalizers: tuple[str, ...] = ()
    deleting: bool = False
    """Its deletion was requested (deletionTimestamp set); finalizers keep it until they are removed."""

    @classmethod
    def from_wire(cls, obj: Obj) -> Self:
        return cls(
            name=obj["name"],
            namespace=obj.get("namespace"),
            uid=obj.get("uid", ""),
            resource_version=obj.get("resourceVersion", ""),
            generation=int(obj.get("generation") or 0),
            created_at=parse_time(obj.get("creationTimestamp")),
            labels=dict(obj.get("labels") or {}),
            annotations=dict(obj.get("annotations") or {}),
            owners=tuple(OwnerRef.from_wire(o) for o in obj.get("ownerReferences") or []),
            finalizers=tuple(str(f) for f in obj.get("finalizers") or []),
            deleting=bool(obj.get("deletionTimestamp")),
        )

    def to_wire(self) -> Obj:
        """What a create sends; server-set fields (uid, resourceVersion, timestamps) are left out."""
        out: Obj = {"name": self.name}
        _put(out, "namespace", self.namespace)
        if self.labels:
            out["labels"] = dict(self.labels)
        if self.annotations:
            out["annotations"] = dict(self.annotations)
        if self.owners:
            out["ownerReferences"] = [o.to_wire() for o in self.owners]
        if self.finalizers:
            out["finalizers"] = list(self.finalizers)
        return out


def remove_finalizer(meta: Meta, finalizer: str) -> list[Obj]:
    """A JSON patch that removes `finalizer` from an object whose metadata was read as `meta`; it
    fails (422, its test op) if the list changed meanwhile, rather than remove someone else's."""
    at = meta.finalizers.index(finalizer)
    where = f"/metadata/finalizers/{at}"
    return [{"op": "test", "path": where, "value": finalizer}, {"op": "remove", "path": where}]


# -- GpuReservation -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ReservationSpec:
    pod_name: str
    """The pod's name, or its generateName prefix followed by '*' until the controller binds it."""
    memory_mib: int
    node_name: str = ""
    gpu_uuid: str = ""
    """Empty while the pod waits in the queue: the placement is written once, when it is placed."""
    gpu_index: int = 0
    admission_uid: str = ""
    admitted_user: str = ""
    gpu_count: int = 1
    """How many GPUs its pod has (one reservation each, sharing the label vramshare.io/reservation-set)."""

    @classmethod
    def from_wire(cls, obj: Obj) -> Self:
        return cls(
            pod_name=obj["podName"],
            memory_mib=int(obj["memoryMiB"]),
            node_name=obj.get("nodeName", ""),
            gpu_uuid=obj.get("gpuUUID", ""),
            gpu_index=int(obj.get("gpuIndex", 0)),
            admission_uid=obj.get("admissionUID", ""),
            admitted_user=obj.get("admittedUser", ""),
            gpu_count=int(obj.get("gpuCount", 1)),
        )

    @property
    def placed(self) -> bool:
        return bool(self.gpu_uuid)

    def to_wire(self) -> Obj:
        out: Obj = {"podName": self.pod_name, "memoryMiB": self.memory_mib}
        if self.placed:
            out |= {"nodeName": self.node_name, "gpuUUID": self.gpu_uuid, "gpuIndex": self.gpu_index}
        if self.admission_uid:
            out["admissionUID"] = self.admission_uid
        if self.admitted_user:
            out["admittedUser"] = self.admitted_user
        if self.gpu_count > 1:
            out["gpuCount"] = self.gpu_count
        return out


@dataclass(frozen=True, kw_only=True)
class ReservationStatus:
    """Written by the controller only. Absent fields are None."""

    phase: ReservationPhase | None = None
    reason: str | None = None
    message: str | None = None
    pod_uid: str | None = None
    pod_running_since: float | None = None
    finished_at: float | None = None
    queue_position: int | None = None
    """While Queued: 1 for the head of the queue."""
    observed_generation: int | None = None

    @classmethod
    def from_wire(cls, obj: Obj) -> Self:
        phase = obj.get("phase")
        return cls(
            phase=ReservationPhase(phase) if phase else None,
            reason=obj.get("reason"),
            message=obj.get("message"),
            pod_uid=obj.get("podUID"),
            pod_running_since=parse_time(obj.get("podRunningSince")),
            finished_at=parse_time(obj.get("finishedAt")),
            queue_position=obj.get("queuePosition"),
            observed_generation=obj.get("observedGeneration"),
        )

    def to_wire(self) -> Obj:
        out: Obj = {}
        _put(out, "phase", self.phase.value if self.phase is not None else None)
        _put(out, "reason", self.reason)
        _put(out, "message", self.message)
        _put(out, "podUID", self.pod_uid)
        if self.pod_running_since is not None:
            out["podRunningSince"] = format_time(self.pod_running_since)
        if self.finished_at is not None:
            out["finishedAt"] = format_time(self.finished_at)
        _put(out, "queuePosition", self.queue_position)
        _put(out, "observedGeneration", self.observed_generation)
        return out


_PLACED_PHASES = (ReservationPhase.RESERVED, ReservationPhase.BOUND, ReservationPhase.LOST)
"""Phases of a booking on a GPU: recorded on an entry without one, its placement was withdrawn."""


@dataclass(frozen=True, kw_only=True)
class GpuReservation:
    meta: Meta
    spec: ReservationSpec
    status: ReservationStatus = field(default_factory=ReservationStatus)

    @classmethod
    def from_wire(cls, obj: Obj) -> Self:
        return cls(
            meta=Meta.from_wire(obj["metadata"]),
            spec=ReservationSpec.from_wire(obj["spec"]),
            status=ReservationStatus.from_wire(obj.get("status") or {}),
        )

    def to_wire(self) -> Obj:
        out: Obj = {
            "apiVersion": API_VERSION,
            "kind": "GpuReservation",
            "metadata": self.meta.to_wire(),
            "spec": self.spec.to_wire(),
        }
        status = self.status.to_wire()
        if status:
            out["status"] = status
        return out

    @classmethod
    def new(
        cls,
        *,
        name: str,
        namespace: str,
        pod: str,
        mib: int,
        gpu: Gpu,
        admission_uid: str,
        user: str = "",
        held_for: str = "",
        set_name: str = "",
        gpu_count: int = 1,
        queued: bool = False,
    ) -> GpuReservation:
        """A booking as the webhook creates it: not yet committed, active. With `held_for`, a hold:
        memory kept for that task's next try, with no pod of its own, labelled committed once it is
        (a pod's booking needs no label: its pod exists only once the commit held). With `set_name`,
        one of the `gpu_count` bookings of a pod with several GPUs."""
        labels = {
            LABEL_GPU: device_name(gpu.uuid),
            LABEL_ACTIVE: "true",
            "app.kubernetes.io/managed-by": "vramshare",
        }
        if held_for:
            labels[LABEL_HELD_FOR] = held_for
            labels[LABEL_COMMITTED] = "false"
        if set_name:
            labels[LABEL_SET] = set_name
        if queued:  # a queue head's hold (see vramshare.controller.queue)
            labels[LABEL_QUEUED] = "true"
        # A hold has no pod: nothing to wait for when it is deleted.
        finalizers = () if held_for else (FINALIZER_POD_GONE,)
        return GpuReservation(
            meta=Meta(name=name, namespace=namespace, labels=labels, finalizers=finalizers),
            spec=ReservationSpec(
                pod_name=pod,
                memory_mib=mib,
                node_name=gpu.node,
                gpu_uuid=gpu.uuid,
                gpu_index=gpu.index,
                admission_uid=admission_uid,
                admitted_user=user,
                gpu_count=gpu_count,
            ),
        )

    @classmethod
    def queued(
        cls, *, name: str, namespace: str, pod: str, mib: int, admission_uid: str, user: str = ""
    ) -> GpuReservation:
        """A queue entry as the webhook creates it: no GPU yet, so it books nothing."""
        return GpuReservation(
            meta=Meta(
                name=name,
                namespace=namespace,
                labels={
                    LABEL_ACTIVE: "true",
                    LABEL_QUEUED: "true",
                    "app.kubernetes.io/managed-by": "vramshare",
                },
                finalizers=(FINALIZER_POD_GONE,),  # its pod exists, and once placed it books memory
            ),
            spec=ReservationSpec(
                pod_name=pod, memory_mib=mib, admission_uid=admission_uid, admitted_user=user
            ),
        )

    def placed_on(self, gpu: Gpu) -> GpuReservation:
        """This queue entry with its placement: the controller's commit writes it."""
        return replace(
            self,
            meta=replace(
                self.meta,
                labels={**self.meta.labels, LABEL_GPU: device_name(gpu.uuid), LABEL_COMMITTED: "false"},
            ),
            spec=replace(self.spec, node_name=gpu.node, gpu_uuid=gpu.uuid, gpu_index=gpu.index),
            status=replace(self.status, queue_position=None),
        )

    @property
    def namespace(self) -> str:
        return self.meta.namespace or ""

    @property
    def name(self) -> str:
        return self.meta.name

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @cached_property  # an immutable object read on every poll and sweep (10 000 of them, issue #31)
    def phase(self) -> ReservationPhase:
        """The recorded phase; none yet means just Reserved (Queued without a GPU). A queue entry the
        controller has placed is Reserved from the moment its spec names the GPU, and one whose
        placement was withdrawn is Queued again, whatever its status last said (Bound, if its pod was
        seen while it was placed)."""
        recorded = self.status.phase
        if recorded is None and self.held_for:
            return ReservationPhase.HELD
        if recorded is None or recorded is ReservationPhase.QUEUED:
            return ReservationPhase.RESERVED if self.spec.placed else ReservationPhase.QUEUED
        if not self.spec.placed and recorded in _PLACED_PHASES:
            return ReservationPhase.QUEUED
        return recorded

    @property
    def committed(self) -> bool:
        """Labelled committed: its GPU's token was moved naming it (see vramshare.kube.ledger.commit). Only
        queue placements and holds carry the label; a pod's own booking is vouched for by its pod."""
        return self.meta.labels.get(LABEL_COMMITTED) == "true"

    @property
    def pod_label(self) -> str:
        """The value of its pod's label vramshare.io/reservation: its own name, or for one of the
        bookings of a pod with several GPUs, the name of the set."""
        return self.meta.labels.get(LABEL_SET) or self.meta.name

    @property
    def held_for(self) -> str:
        """For a hold: the key of the task it keeps memory for."""
        return self.meta.labels.get(LABEL_HELD_FOR, "")

    @property
    def queue_entry(self) -> bool:
        """Made for a pod that waits in the queue (entries made before the label: by their status)."""
        return self.meta.labels.get(LABEL_QUEUED) == "true" or self.status.phase is ReservationPhase.QUEUED

    @property
    def waits_for_pod_gone(self) -> bool:
        """Carries vramshare's finalizer: once deleted, it stays (and counts) until the controller has
        seen its pod terminate."""
        return FINALIZER_POD_GONE in self.meta.finalizers

    @property
    def labelled_active(self) -> bool:
        """False once the controller labelled it ended; unlabelled (made by hand) counts as active."""
        return self.meta.labels.get(LABEL_ACTIVE) != "false"

    def to_domain(self) -> Reservation:
        return self._domain

    @cached_property
    def _domain(self) -> Reservation:
        # Once per object, not per look: the controller's poll converted its whole ledger every time.
        return Reservation(
            name=self.meta.name,
            namespace=self.namespace,
            pod=self.spec.pod_name,
            mib=self.spec.memory_mib,
            node=self.spec.node_name,
            gpu_uuid=self.spec.gpu_uuid,
            gpu_index=self.spec.gpu_index,
            phase=self.phase,
            reserved_at=self.meta.created_at or 0.0,
            pod_running_since=self.status.pod_running_since,
            finished_at=self.status.finished_at,
            held_for=self.held_for,
            user=self.spec.admitted_user,
            queue_entry=self.queue_entry,
            pod_label=self.pod_label,
        )


# -- GpuDevice ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    uuid: str
    node_name: str
    index: int
    model: str = ""

    @classmethod
    def from_wire(cls, obj: Obj) -> Self:
        return cls(
            uuid=obj["uuid"],
            node_name=obj["nodeName"],
            index=int(obj["index"]),
            model=obj.get("model", ""),
        )

    def to_wire(self) -> Obj:
        return {"uuid": self.uuid, "nodeName": self.node_name, "index": self.index, "model": self.model}


@dataclass(frozen=True, kw_only=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str
    last_transition: float
    observed_generation: int = 0
    """The object's generation this condition was judged for (Kubernetes API conventions)."""

    @classmethod
    def from_wire(cls, obj: Obj) -> Self:
        return cls(
            type=str(obj.get("type", "")),
            status=obj.get("status") == "True",
            reason=str(obj.get("reason", "")),
            message=str(obj.get("message", "")),
            last_transition=parse_time(obj.get("lastTransitionTime")) or 0.0,
            observed_generation=int(obj.get("observedGeneration") or 0),
        )

    def to_wire(self) -> Obj:
        out: Obj = {
            "type": self.type,
            "status": "True" if self.status else "False",
            "reason": self.reason,
            "message": self.message,
            "lastTransitionTime": format_time(self.last_transition),
        }
        if self.observed_generation:
            out["observedGeneration"] = self.observed_generation
        return out


@dataclass(frozen=True, kw_only=True)
class Delivery:
    """status.delivery: the configured mode's result on the GPU's node, and every mode's."""

    mode: str
    result: str
    message: str
    modes: tuple[Check, ...] = ()

    @classmethod
    def of(cls, mode: str, checks: tuple[Check, ...]) -> Self:
        chosen = next(c for c in checks if c.mode == mode)
        return cls(mode=mode, result=chosen.result.value, message=chosen.message, modes=checks)

    @classmethod
    def from_wire(cls, obj: Obj) -> Self:
        return cls(
            mode=str(obj.get("mode", "")),
            result=str(obj.get("result", "")),
            message=str(obj.get("message", "")),
            modes=tuple(
                Check(
                    mode=str(m.get("mode", "")), result=Result(m["result"]), message=str(m.get("message", ""))
                )
                for m in obj.get("modes") or []
                if isinstance(m, dict) and m.get("result") in Result.__members__.values()
            ),
        )

    def to_wire(self) -> Obj:
        return {
            "mode": self.mode,
            "result": self.result,
            "message": self.message,
            "modes": [{"mode": c.mode, "result": c.result.value, "message": c.message} for c in self.modes],
        }


@dataclass(frozen=True, kw_only=True)
class DeviceStatus:
    """What the controller publishes about one GPU (figures in MiB)."""

    total_mib: int
    used_mib: int
    free_mib: int
    driver_reserved_mib: int
    reserved_mib: int
    headroom_mib: int
    sampled_at: float
    last_seen_at: float | None
    state: str
    """Ready, Stale, Missing or Unhealthy: a summary of the conditions for `kubectl get`."""
    conditions: tuple[Condition, ...] = ()
    observed_generation: int = 0
    mig: tuple[MigInstance, ...] = ()
    """A MIG-enabled GPU's instances (never handed to pods); empty for a whole GPU."""
    delivery: Delivery | None = None
    """The delivery preflight on the GPU's node (see vramshare.domain.delivery_judgement)."""

    @classmethod
    def from_wire(cls, obj: Obj) -> Self | None:
        """None while the GPU has no sample yet."""
        sampled_at = parse_time(obj.get("sampledAt"))
        if sampled_at is None or "totalMiB" not in obj:
            return None
        return cls(
            total_mib=int(obj["totalMiB"]),
            used_mib=int(obj.get("usedMiB", 0)),
            free_mib=int(obj.get("freeMiB", 0)),
            driver_reserved_mib=int(obj.get("driverReservedMiB", 0)),
            reserved_mib=int(obj.get("reservedMiB", 0)),
            headroom_mib=int(obj.get("headroomMiB", 0)),
            sampled_at=sampled_at,
            last_seen_at=parse_time(obj.get("lastSeenAt")),
            state=str(obj.get("state", "")),
            conditions=tuple(Condition.from_wire(c) for c in obj.get("conditions") or []),
            observed_generation=int(obj.get("observedGeneration") or 0),
            mig=tuple(_mig_from_wire(i) for i in (obj.get("mig") or {}).get("instances") or []),
            delivery=Delivery.from_wire(obj["delivery"]) if isinstance(obj.get("delivery"), dict) else None,
        )

    def to_wire(self) -> Obj:
        out: Obj = {
            "totalMiB": self.total_mib,
            "usedMiB": self.used_mib,
            "freeMiB": self.free_mib,
            "driverReservedMiB": self.driver_reserved_mib,
            "reservedMiB": self.reserved_mib,
            "headroomMiB": self.headroom_mib,
            "sampledAt": format_time_precise(self.sampled_at),
            "state": self.state,
            "conditions": [c.to_wire() for c in self.conditions],
        }
        if self.last_seen_at is not None:
            out["lastSeenAt"] = format_time_precise(self.last_seen_at)
        if self.observed_generation:
            out["observedGeneration"] = self.observed_generation
        if self.mig:
            out["mig"] = {
                "enabled": True,
                "summary": mig_summary(self.mig),
                "instances": [_mig_to_wire(i) for i in self.mig],
            }
        if self.delivery is not None:
            out["delivery"] = self.delivery.to_wire()
        return out

    def condition(self, kind: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == kind), None)


@dataclass(frozen=True, kw_only=True)
class GpuDevice:
    meta: Meta
    spec: DeviceSpec
    status: DeviceStatus | None = None

    @classmethod
    def from_wire(cls, obj: Obj) -> Self:
        return cls(
            meta=Meta.from_wire(obj["metadata"]),
            spec=DeviceSpec.from_wire(obj["spec"]),
            status=DeviceStatus.from_wire(obj.get("status") or {}),
        )

    def to_wire(self) -> Obj:
        out: Obj = {
            "apiVersion": API_VERSION,
            "kind": "GpuDevice",
            "metadata": self.meta.to_wire(),
            "spec": self.spec.to_wire(),
        }
        if self.status is not None:
            out["status"] = self.status.to_wire()
        return out

    @classmethod
    def new(cls, spec: DeviceSpec) -> GpuDevice:
        """A GpuDevice as the controller first creates it, named after the UUID."""
        return GpuDevice(meta=Meta(name=device_name(spec.uuid)), spec=spec)

    @property
    def ledger_token(self) -> str:
        """The resourceVersion every commit on this GPU must move (see vramshare.kube.ledger.commit)."""
        return self.meta.resource_version

    def to_domain(self) -> Gpu | None:
        """The domain's view of the GPU, or None when it has no sample yet."""
        if self.status is None:
            return None
        return Gpu(
            uuid=self.spec.uuid,
            node=self.spec.node_name,
            index=self.spec.index,
            model=self.spec.model,
            total_mib=self.status.total_mib,
            used_mib=self.status.used_mib,
            free_mib=self.status.free_mib,
            sampled_at=self.status.sampled_at,
            healthy=self.status.state != "Unhealthy",
            missing=self.status.state == DeviceState.MISSING.value,
            mig=self.status.mig,
        )


def _mig_to_wire(instance: MigInstance) -> Obj:
    out: Obj = {"profile": instance.profile, "instanceID": instance.instance_id}
    if instance.used_mib is not None:
        out["usedMiB"] = instance.used_mib
    if instance.free_mib is not None:
        out["freeMiB"] = instance.free_mib
    return out


def _mig_from_wire(obj: Obj) -> MigInstance:
    used, free = obj.get("usedMiB"), obj.get("freeMiB")
    return MigInstance(
        profile=str(obj.get("profile", "")),
        instance_id=int(obj.get("instanceID", 0)),
        used_mib=int(used) if used is not None else None,
        free_mib=int(free) if free is not None else None,
    )
