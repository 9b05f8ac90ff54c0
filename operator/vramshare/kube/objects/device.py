"""GpuDevice as a typed value: one GPU, its spec and the status the inventory writes, from and to the
wire."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from vramshare.domain import Gpu
from vramshare.domain.delivery_judgement import Check, Result
from vramshare.domain.inventory import DeviceState
from vramshare.domain.models import MigInstance, mig_summary
from vramshare.kube.objects.meta import Meta, Obj
from vramshare.kube.resources import (
    API_VERSION,
    device_name,
    format_time,
    format_time_precise,
    parse_time,
)


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
            not_shared=self._not_shared(),
        )

    @property
    def not_shared_reason(self) -> str:
        """Why the GPU is not shared (its Ready condition's message), or "" where it is."""
        return self._not_shared()

    def _not_shared(self) -> str:
        """Why the controller found the GPU not vramshare's to share (its Ready condition says)."""
        if self.status is None or self.status.state != DeviceState.NOT_SHARED.value:
            return ""
        ready = self.status.condition("Ready")
        return (ready.message if ready is not None else "") or "another allocator hands it out"


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
