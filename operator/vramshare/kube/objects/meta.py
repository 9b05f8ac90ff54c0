"""The metadata every vramshare object carries, and the wire helpers the kinds share."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Self

from vramshare.kube.resources import (
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
