"""GpuReservation as a typed value: a booking (or a queue entry, or a hold), from and to the wire."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Self

from vramshare.domain import Gpu, Reservation, ReservationPhase
from vramshare.domain.grants import MAX_LASTS_S, MIN_LASTS_S
from vramshare.kube.objects.meta import Meta, Obj, _put
from vramshare.kube.resources import (
    ANNOTATION_GRANT_LASTS,
    ANNOTATION_GRANTED_TO,
    API_VERSION,
    FINALIZER_POD_GONE,
    LABEL_ACTIVE,
    LABEL_COMMITTED,
    LABEL_GPU,
    LABEL_GRANTED_TO,
    LABEL_HELD_FOR,
    LABEL_QUEUED,
    LABEL_SET,
    device_name,
    format_time,
    parse_time,
)


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
    grant: str = ""
    """Made inside a grant (`vramshare.domain.grants`): the grant's namespace/name."""

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
            grant=obj.get("grant", ""),
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
        if self.grant:
            out["grant"] = self.grant
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
    def granted(
        cls,
        *,
        name: str,
        namespace: str,
        mib: int,
        gpu_uuid: str,
        node: str,
        gpu_index: int,
        holder: str,
        holder_hash: str,
        lasts_s: float,
    ) -> GpuReservation:
        """A grant as a webhook replica takes it: `mib` on `gpu` for `holder`'s pods
        (`vramshare.domain.grants`). No pod, so no finalizer; labelled with the holder's hash."""
        return GpuReservation(
            meta=Meta(
                name=name,
                namespace=namespace,
                labels={
                    LABEL_GPU: device_name(gpu_uuid),
                    LABEL_ACTIVE: "true",
                    LABEL_GRANTED_TO: holder_hash,
                    "app.kubernetes.io/managed-by": "vramshare",
                },
                annotations={ANNOTATION_GRANTED_TO: holder, ANNOTATION_GRANT_LASTS: f"{lasts_s:g}"},
            ),
            spec=ReservationSpec(
                pod_name=f"(granted to {holder})"[:254],
                memory_mib=mib,
                node_name=node,
                gpu_uuid=gpu_uuid,
                gpu_index=gpu_index,
            ),
        )

    def inside(self, grant_key: str) -> GpuReservation:
        """This booking, made inside the grant `grant_key`."""
        return replace(self, spec=replace(self.spec, grant=grant_key))

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
        """The recorded phase; none yet (or the CRD's default, Reserved) means just Reserved (Queued
        without a GPU, Held for a hold). A queue entry the
        controller has placed is Reserved from the moment its spec names the GPU, and one whose
        placement was withdrawn is Queued again, whatever its status last said (Bound, if its pod was
        seen while it was placed)."""
        recorded = self.status.phase
        # Reserved is also what the API server shows where nothing was written (the CRD's default).
        if recorded in (None, ReservationPhase.RESERVED) and self.held_for:
            return ReservationPhase.HELD
        if recorded in (None, ReservationPhase.RESERVED) and self.granted_to:
            return ReservationPhase.GRANTED
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
    def granted_to(self) -> str:
        """For a grant: the hash of the webhook replica that holds it."""
        return self.meta.labels.get(LABEL_GRANTED_TO, "")

    @property
    def grant_lasts_s(self) -> float:
        """For a grant: how long it lasts unrenewed, as its holder wrote it. A value that does not parse,
        or lies outside 3..3600 s, reads as the longest: ending a grant too late costs room for a while,
        ending it too early could let two pods share its memory."""
        try:
            lasts = float(self.meta.annotations.get(ANNOTATION_GRANT_LASTS, ""))
        except ValueError:
            return MAX_LASTS_S
        return lasts if MIN_LASTS_S <= lasts <= MAX_LASTS_S else MAX_LASTS_S

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
            pod_seen=bool(self.status.pod_uid),
            grant=self.spec.grant,
            acknowledged=self.status.phase is ReservationPhase.GRANTED,
        )
