"""Fakes and builders shared by the webhook's unit tests: an in-memory ledger, review requests, an
Admitter on them, and reading a patch back."""

from __future__ import annotations

import asyncio
import base64
import copy
import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from tests.unit.domain.builders import NOW, gpu
from vramshare.domain import Accounting
from vramshare.domain.snapshot import CommitConflictError, Snapshot
from vramshare.kube.objects import GpuReservation
from vramshare_webhook import review as rv
from vramshare_webhook.admission import Admitter, ClusterView
from vramshare_webhook.metrics import WebhookMetrics
from vramshare_webhook.settings import WebhookSettings


class MemoryLedger:
    def __init__(self, *, conflicts: int = 0, fail: Exception | None = None) -> None:
        self.gpus = (gpu("GPU-a", total=16_384), gpu("GPU-b", index=1, total=8_192))
        self.objects: list[GpuReservation] = []
        self.conflicts = conflicts
        self.fail = fail
        self.fresh_reads = 0
        self.carried: set[str] = set()
        """Reservations some pod already carries."""
        self.hang_commit = False
        self.rate = 0.0
        """MiB per second freed lately (for Retry-After)."""
        self.conflict_on: set[str] = set()
        """GPUs whose next commit loses its race (once each)."""
        self.withdrawn: list[str] = []
        self.in_view: set[str] = set()
        """Bookings put into the view ahead of their commits (a set's)."""
        self.pods: set[str] = set()
        """Names of pods that exist."""
        self.grant_rooms: list[int | None] = []
        """Each commit's `grant_room_mib`."""
        self.relieved: list[dict[str, int | None]] = []
        """What each `relieve_grants` was told of each GPU's room."""
        self.granted: dict[str, int] = {}
        """What `grant_credit` answers: GPU UUID -> MiB this replica's grant there holds."""

    def relieve_grants(self, room_for_others: Callable[[str], int | None]) -> None:
        self.relieved.append({g.uuid: room_for_others(g.uuid) for g in self.gpus})

    def grant_credit(self, mib: int) -> dict[str, int]:
        return {uuid: left for uuid, left in self.granted.items() if left >= mib}

    async def snapshot(self, *, fresh: bool = False) -> Snapshot:
        self.fresh_reads += fresh
        if self.fail:
            raise self.fail
        return Snapshot(
            gpus=self.gpus,
            reservations=tuple(o.to_domain() for o in self.objects),
            tokens={g.uuid: "1" for g in self.gpus},
        )

    async def get_reservation(self, namespace: str, name: str) -> GpuReservation | None:
        return next((o for o in self.objects if o.name == name), None)

    async def claim_reinvocation(self, reservation: GpuReservation, *, claimant: str) -> bool:
        current = next(o for o in self.objects if o.name == reservation.name)
        if "vramshare.io/reinvoked-by" in current.meta.annotations:
            return False
        claimed = replace(
            current, meta=replace(current.meta, annotations={"vramshare.io/reinvoked-by": claimant})
        )
        self.objects = [claimed if o is current else o for o in self.objects]
        return True

    async def pod_carries(self, namespace: str, reservation: str) -> bool:
        return reservation in self.carried

    async def pod_exists(self, namespace: str, name: str) -> bool:
        return name in self.pods

    async def pod_labels(self, namespace: str) -> set[str]:
        return set(self.carried)

    async def active_holds(self) -> list[GpuReservation]:
        return [o for o in self.objects if o.held_for and o.phase.is_active]

    async def commit(
        self,
        *,
        reservation: GpuReservation,
        token: str,
        live: bool = False,
        grant_room_mib: int | None = None,
    ) -> GpuReservation:
        self.grant_rooms.append(grant_room_mib)
        if self.hang_commit:
            await asyncio.sleep(3600)
        if self.conflicts:
            self.conflicts -= 1
            raise CommitConflictError("moved")
        if reservation.spec.gpu_uuid in self.conflict_on:
            self.conflict_on.discard(reservation.spec.gpu_uuid)
            await asyncio.sleep(0)  # the other GPU's commit lands first
            raise CommitConflictError("moved")
        created = replace(reservation, meta=replace(reservation.meta, created_at=NOW))
        self.objects.append(created)
        return created

    async def enqueue(self, reservation: GpuReservation) -> GpuReservation:
        return await self.commit(reservation=reservation, token="")

    def decided(self, reservation: GpuReservation) -> None:
        self.in_view.add(reservation.name)

    def undecided(self, reservation: GpuReservation) -> None:
        self.in_view.discard(reservation.name)

    async def withdraw(self, created: GpuReservation) -> None:
        self.withdrawn.append(created.name)
        self.objects = [o for o in self.objects if o.name != created.name]

    async def withdraw_hold(self, namespace: str, name: str) -> None:
        self.objects = [o for o in self.objects if o.name != name]

    def release_rate(self, gpu_uuid: str | None = None) -> float:
        return self.rate


def request(mib: str | None = "4096", *, uid: str = "u1", dry_run: bool = False, **meta: Any) -> rv.Request:
    annotations = {"gpu-mem-mb": mib} if mib is not None else {}
    annotations.update(meta.pop("annotations", {}))
    pod = {
        "metadata": {"name": "task", "annotations": annotations, **meta},
        "spec": {"containers": [{"name": "base", "image": "x"}]},
    }
    return rv.Request(
        uid=uid,
        operation="CREATE",
        namespace="airflow",
        name="task",
        kind="Pod",
        object=pod,
        old_object=None,
        dry_run=dry_run,
        username="airflow",
    )


def admitter(
    ledger: MemoryLedger,
    *,
    cluster: ClusterView | None = None,
    clock: Callable[[], float] = lambda: NOW,
    **settings: Any,
) -> Admitter:
    """An Admitter on `ledger`, no safety margin, the settings given, and what it sees of the cluster."""
    return Admitter(
        settings=WebhookSettings(accounting=Accounting(safety_margin_mib=0), **settings),
        ledger=ledger,
        metrics=WebhookMetrics(),
        clock=clock,
        cluster=cluster,
    )


def patch_of(review: rv.Review) -> list[dict[str, Any]]:
    return json.loads(base64.b64decode(review["response"]["patch"]))  # type: ignore[no-any-return]


def airflow(task: str, try_number: int = 1) -> dict[str, str]:
    return {"dag_id": "train", "task_id": task, "run_id": "manual-1", "try_number": str(try_number)}


def with_spec(req: rv.Request, **spec: Any) -> rv.Request:
    pod = copy.deepcopy(req.object)
    pod["spec"].update(spec)
    return replace(req, object=pod)


def delivering(ledger: MemoryLedger, *, label: str | None = None, **settings: Any) -> Admitter:
    return admitter(
        ledger,
        cluster=ClusterView(
            namespace_labels=lambda namespace: {"vramshare.io/delivery": label} if label else {}
        ),
        **settings,
    )


def apply(doc: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """A minimal JSON Patch 'add' (all we emit), resolving RFC 6901 pointers."""
    doc = copy.deepcopy(doc)
    for op in ops:
        assert op["op"] == "add"
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        target = doc
        for part in parts[:-1]:
            target = target[int(part)] if isinstance(target, list) else target.setdefault(part, {})
        last = parts[-1]
        if isinstance(target, list):
            target.insert(int(last), op["value"])
        else:
            target[last] = op["value"]
    return doc


def applied(req: rv.Request, review: rv.Review) -> rv.Request:
    """The request as the API server sends it again after a later webhook: the first pass's patch
    applied (plus a sidecar container), under a new request UID."""
    pod = apply(req.object, patch_of(review))
    pod["spec"]["containers"].append({"name": "sidecar", "image": "proxy"})
    return replace(req, uid=req.uid + "-again", object=pod)


def env_of(review: rv.Review, container: int = 0) -> dict[str, Any]:
    """A container's environment as the patch sets it: name -> value (or valueFrom)."""
    ops = {op["path"]: op["value"] for op in patch_of(review)}
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in ops[f"/spec/containers/{container}/env"]}


def env_list(review: rv.Review) -> list[dict[str, Any]]:
    """The first container's environment as the patch sets it."""
    return next(op["value"] for op in patch_of(review) if op["path"] == "/spec/containers/0/env")  # type: ignore[no-any-return]


TLS_FILES = {"VRAMSHARE_TLS_CERT_FILE": "/tls/tls.crt", "VRAMSHARE_TLS_KEY_FILE": "/tls/tls.key"}
"""The TLS files every webhook setting needs."""
