"""The queue loop: place waiting pods on GPUs as memory frees up, then lift their scheduling gates.

A queued pod was admitted behind the scheduling gate `vramshare.io/gpu-memory` with a Queued
GpuReservation (no GPU). On every pass, woken by a pod or reservation change or every
`queue_interval_s`, the leader:

1. lifts the gate of every pod whose entry is placed and committed but whose pod still waits (a pass
   that placed it and then stopped, e.g. a failover in between, is finished by the next leader). A
   placement that is not labelled committed was written by a leader that stopped before its commit
   was known to hold (or whose commit failed and could not be withdrawn): nobody vouches for it, so
   it goes back to the queue and is placed again through the commit. Its pod is marked first
   (`vramshare.io/placement-withdrawn`, conditional on the pod as read): the leader that placed it may
   have stalled with the pod's release on its way, conditional on that same version, so exactly one
   of the two lands, and a release that finds its placement withdrawn is not retried;
2. plans the queue with the pure `plan_queue` (fair share across namespaces by their weights, the
   label vramshare.io/queue-weight, oldest first within one, backfill, a bounded hold for the head)
   over the ledger's view, and places each pod through the ledger's commit (the same protocol and
   conflict handling as an admission), then writes the GPU into its annotations, pins it to the
   GPU's node and lifts its gate; the kubelet resolves NVIDIA_VISIBLE_DEVICES from the annotation
   when the container starts;
3. keeps the head's hold in the ledger: a GpuReservation in phase Held (labelled
   vramshare.io/queued) booking the head's MiB on the held GPU, committed like any booking. So the
   webhook counts it too, and a pod created meanwhile cannot take the memory that frees there for the
   head (it is admitted elsewhere, queued or refused). The hold is withdrawn when the head is placed
   or the hold moves on;
4. writes each waiting entry's position (and, for the head, the GPU held for it) to its status.

The queue is the set of Queued GpuReservations, ordered by creation time, and the head's hold a
GpuReservation too: both live in the API server, so a new leader continues them, the hold with its
start time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
import time
from collections.abc import Callable

import structlog

from vramshare.controller.metrics import ControllerMetrics
from vramshare.controller.settings import ControllerSettings
from vramshare.controller.state import ClusterState
from vramshare.domain import Hold, ReservationPhase, Waiting, plan_queue
from vramshare.domain.guardrails import fraction_of
from vramshare.domain.queue import QueuePlan, parse_weight
from vramshare.domain.scheduling import schedulable_nodes
from vramshare.domain.snapshot import CommitConflictError, Snapshot
from vramshare.domain.tenancy import holdings_of
from vramshare.kube.client import ApiError, KubeClient, Obj
from vramshare.kube.conditional import annotate_unchanged
from vramshare.kube.events import Event, Involved, post_event
from vramshare.kube.ledger import KubeLedger
from vramshare.kube.objects import GpuReservation
from vramshare.kube.pods import (
    ANNOTATION_FRACTION,
    ANNOTATION_MPS_LIMIT,
    MODEL_ANNOTATION,
    MPS_LABEL,
    PLACEMENT_WITHDRAWN,
    gated,
    node_rules,
    other_gates,
    placement_annotations,
    placement_id,
    release_patch,
)
from vramshare.kube.resources import LABEL_QUEUE_WEIGHT, device_name, pod_path, reservations_path

log = structlog.get_logger("vramshare.queue")

QUEUE_HOLD_PREFIX = "queue-"


def queue_hold_key(entry_key: str) -> str:
    """The held-for label of the hold kept for a queue entry (a label value: hashed to fit)."""
    return QUEUE_HOLD_PREFIX + hashlib.sha256(entry_key.encode()).hexdigest()[:40]


QUEUE_MESSAGE_START = "waits for"
"""How the status message of a waiting entry starts (the queue wrote it: the pod was told)."""


class QueueLoop:
    def __init__(
        self,
        *,
        kube: KubeClient,
        ledger: KubeLedger,
        state: ClusterState,
        settings: ControllerSettings,
        metrics: ControllerMetrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.kube = kube
        self.ledger = ledger
        self.state = state
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self.hold: Hold | None = None
        self._wake = asyncio.Event()
        self._entries: dict[str, GpuReservation] = {}
        """The queue's own GpuReservations (entries, placed or not, and the head's holds), kept from
        the state's watch: a pass looks at these, not at every booking in the cluster (with 10 000
        bookings and a pass per reservation event, scanning them all kept the controller busy)."""
        for key, res in state.reservations.items.items():
            self._seen(key, res, None)
        state.reservations.on_change(self._seen)
        self._placed: set[str] = set()
        """Entries this leader placed: committed, whether or not the state's cache shows the label."""
        self._bad_weights: set[str] = set()
        """Namespaces whose weight label was not a valid weight (logged once each)."""

    def _seen(self, key: str, res: GpuReservation | None, _previous: GpuReservation | None) -> None:
        if res is not None and res.queue_entry:
            self._entries[key] = res
            self._wake.set()
        elif self._entries.pop(key, None) is not None:
            self._wake.set()

    def wake(self) -> None:
        """Something changed (a pod ended, a reservation was released or queued): plan again now. With
        no queue (no entry, no hold kept for a head) a pass has nothing to do, and every pod and booking
        event of the cluster woke one for nothing (issue #45); an entry coming or going wakes it itself
        (`_seen`), and the periodic pass runs regardless."""
        if self._entries or self.hold is not None:
            self._wake.set()

    async def run(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self.step()
            except Exception as exc:  # the next pass tries again
                log.warning("queue pass failed", error=str(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.settings.queue_interval_s)

    def _pod_of(self, res: GpuReservation, pods: dict[tuple[str, str], list[Obj]]) -> Obj | None:
        uid = res.status.pod_uid
        return next((p for p in pods.get((res.namespace, res.name), []) if p["metadata"]["uid"] == uid), None)

    async def step(self) -> int:
        """One pass; returns how many pods it placed."""
        if not self._entries:  # no queue: nothing to place, release, hold or number
            self.metrics.queued.set(0)
            self.hold = None
            return 0
        pods = self.state.pods_by_reservation()
        entries = list(self._entries.values())
        for res in entries:
            if res.spec.placed and res.phase.is_active and res.status.pod_uid:
                pod = self._pod_of(res, pods)
                if pod is None or not gated(pod):
                    continue
                if res.committed or res.key in self._placed:
                    await self._release(res, pod)
                elif await self._fence(res, pod) and await self.ledger.unplace(res):
                    log.warning("placement not known to be committed; back in the queue", reservation=res.key)
        # Forget own placements once the cache shows them labelled, or gone.
        self._placed &= {res.key for res in entries if not res.committed}
        queued: dict[str, tuple[GpuReservation, Obj]] = {}
        for res in entries:
            if res.phase is not ReservationPhase.QUEUED or not res.status.pod_uid:
                continue  # its pod has not been seen yet: nothing to place
            if res.meta.deleting:
                continue  # deleted (its namespace, or its pod in the foreground): it will not run
            placed_meanwhile = self.ledger.reservations.items.get(res.key)
            if placed_meanwhile is not None and placed_meanwhile.is_active:
                continue  # this process placed it a moment ago; the state's cache is behind
            pod = self._pod_of(res, pods)
            # A pod another admission system still holds (Kueue's gate) books nothing until it lets go.
            if pod is not None and gated(pod) and not other_gates(pod):
                queued[res.key] = (res, pod)
        self.metrics.queued.set(len(queued))
        if not queued:
            self.hold = None
            # Nothing waits: no hold is kept for a head that left (deleted, or held by another admission
            # system again), rather than until the hold lapses (issue #42, 8).
            for h in self._queue_holds():
                await self.ledger.withdraw_hold(h.namespace, h.name)
            return 0
        now = self.clock()
        snapshot = await self.ledger.snapshot()
        nodes = list(self.state.nodes.items.values())
        gpu_nodes = {g.node for g in snapshot.gpus}
        waiting = [
            Waiting(
                key=key,
                namespace=res.namespace,
                pod=res.spec.pod_name,
                mib=res.spec.memory_mib,
                queued_at=res.meta.created_at or 0.0,
                # Only nodes the scheduler could bind it to (as the webhook judges at admission).
                nodes=schedulable_nodes(nodes, node_rules(pod), gpu_nodes=gpu_nodes)[0] if nodes else None,
                model=(pod["metadata"].get("annotations") or {}).get(MODEL_ANNOTATION),
            )
            for key, (res, pod) in queued.items()
        ]
        holds = self._queue_holds()
        if self.hold is None:  # a new leader: the hold the last one kept, with its start
            by_key = {queue_hold_key(k): k for k in queued}
            for h in holds:
                if h.held_for in by_key:
                    since = h.meta.created_at or now
                    self.hold = Hold(key=by_key[h.held_for], gpu_uuid=h.spec.gpu_uuid, since=since)
                    break
        # The plan keeps the held GPU for the head itself; the hold's booking is for everyone else.
        hold_keys = {h.key for h in holds}
        ledger = [
            r
            for r in (snapshot.index.reservations() if snapshot.index is not None else snapshot.reservations)
            if f"{r.namespace}/{r.name}" not in hold_keys
        ]
        namespaces = {w.namespace for w in waiting}
        held_mib = {ns: self._held_mib(snapshot, ns) for ns in namespaces}
        weights = {ns: self._weight(ns) for ns in namespaces}
        log.debug("planning the queue", waiting=len(waiting), held_mib=held_mib, weights=weights)
        plan = plan_queue(
            waiting,
            snapshot.gpus,
            ledger,
            settings=self.settings.allocation,
            queue=self.settings.queue,
            hold=self.hold,
            now=now,
            held_mib=held_mib,
            weights=weights,
        )
        self.hold = plan.hold
        placed = 0
        for w, choice in plan.placements:
            res, pod = queued[w.key]
            try:
                booked = await self.ledger.place(
                    entry=res, gpu=choice.gpu, token=snapshot.tokens[choice.gpu.uuid], live=snapshot.live
                )
            except CommitConflictError:
                self.wake()  # another commit on that GPU: plan again on a fresh view
                break
            except ApiError as exc:
                if exc.conflict or exc.not_found:  # the entry changed or went (its pod was deleted)
                    self.wake()
                    continue
                raise
            placed += 1
            self._placed.add(res.key)
            self.metrics.queue_placements.inc()
            self.metrics.queue_wait.observe(max(0.0, now - w.queued_at))
            log.info(
                "placed from the queue",
                reservation=res.key,
                gpu=choice.gpu.uuid,
                node=choice.gpu.node,
                mib=w.mib,
                waited_s=round(now - w.queued_at, 1),
            )
            await self._release(booked, pod)
        await self._keep_hold(plan, holds, {w.key: w for w in waiting}, snapshot)
        await self._write_positions(queued, plan.positions, now=now)
        return placed

    def _queue_holds(self) -> list[GpuReservation]:
        """The head's holds in the ledger (one, but a failover or a race may leave more)."""
        return [
            r
            for r in self._entries.values()
            if r.held_for.startswith(QUEUE_HOLD_PREFIX)
            and r.phase is ReservationPhase.HELD
            and r.labelled_active
        ]

    @staticmethod
    def _held_mib(snapshot: Snapshot, namespace: str) -> int:
        """What a namespace holds for its fair share: its bookings (not what waits in the queue)."""
        if snapshot.index is not None:
            held = snapshot.index.holdings(namespace)
        else:
            held = holdings_of(snapshot.reservations, namespace)
        return held.bound_mib + held.pending_mib + held.held_mib

    def _weight(self, namespace: str) -> float:
        labels = self.state.namespaces.items.get(f"/{namespace}", {})
        value = labels.get(LABEL_QUEUE_WEIGHT)
        weight = parse_weight(value)
        if weight is None:
            if value is not None and namespace not in self._bad_weights:
                self._bad_weights.add(namespace)
                log.warning(
                    "namespace label vramshare.io/queue-weight is not a number above 0 and at most 1000; "
                    "weight 1 is used",
                    namespace=namespace,
                    value=value,
                )
            return 1.0
        self._bad_weights.discard(namespace)
        return weight

    async def _keep_hold(
        self, plan: QueuePlan, existing: list[GpuReservation], waiting: dict[str, Waiting], snapshot: Snapshot
    ) -> None:
        """Make the ledger hold what the plan holds for the head: keep a matching hold, withdraw the
        others, commit a new one where there is none."""
        hold = plan.hold
        wanted = (queue_hold_key(hold.key), hold.gpu_uuid) if hold is not None else None
        kept = False
        for h in existing:
            if not kept and (h.held_for, h.spec.gpu_uuid) == wanted:
                kept = True
                continue
            await self.ledger.withdraw_hold(h.namespace, h.name)
        if hold is None or kept:
            return
        head = waiting[hold.key]
        gpu = next((g for g in snapshot.gpus if g.uuid == hold.gpu_uuid), None)
        if gpu is None:
            return
        booking = GpuReservation.new(
            name=f"queue-hold-{secrets.token_hex(4)}",
            namespace=head.namespace,
            pod=head.pod,
            mib=head.mib,
            gpu=gpu,
            admission_uid="",
            user=self.settings.identity,
            held_for=queue_hold_key(hold.key),
            queued=True,
        )
        try:
            await self.ledger.commit(reservation=booking, token=snapshot.tokens[gpu.uuid], live=snapshot.live)
        except CommitConflictError:
            self.wake()  # another commit on that GPU: the next pass holds it again
            return
        log.info("holding a GPU for the head of the queue", reservation=hold.key, gpu=gpu.uuid, mib=head.mib)

    async def _fence(self, res: GpuReservation, pod: Obj) -> bool:
        """Before taking back a placement nobody vouches for, mark its pod as withdrawn, conditional on
        the pod as read: a leader that placed it and stalled may still have the release on its way,
        conditional on that same version, so exactly one of the two lands. False when the release got
        there first (the pod no longer waits: the placement stands)."""
        meta = pod["metadata"]
        path = pod_path(meta["namespace"], meta["name"])
        fence = placement_id(res.name, res.meta.generation)
        return await annotate_unchanged(
            self.kube,
            path,
            version=pod["metadata"]["resourceVersion"],
            annotations={PLACEMENT_WITHDRAWN: fence},
            still=gated,
            attempts=3,
        )

    async def _release(self, res: GpuReservation, pod: Obj) -> None:
        """Write the placement into the gated pod and lift the gate (read again if it changed), unless
        another leader took this placement back meanwhile (see `_fence`)."""
        meta = pod["metadata"]
        fence = placement_id(res.name, res.meta.generation)
        path = pod_path(meta["namespace"], meta["name"])
        spec = res.spec
        annotations = placement_annotations(
            reservation=res.name,
            gpu_uuid=spec.gpu_uuid,
            gpu_index=spec.gpu_index,
            node=spec.node_name,
        )
        # The budget variables that depend on the GPU read these (see vramshare.domain.guardrails).
        device = self.ledger.devices.items.get(f"/{device_name(spec.gpu_uuid)}")
        gpu = device.to_domain() if device is not None else None
        node = self.state.nodes.items.get(f"/{spec.node_name}")
        mps = node is not None and node.labels.get(MPS_LABEL) == "true"
        annotations[ANNOTATION_FRACTION] = (
            f"{fraction_of(spec.memory_mib, gpu.total_mib):.2f}" if gpu is not None else "1.00"
        )
        annotations[ANNOTATION_MPS_LIMIT] = f"0={spec.memory_mib}M" if mps else ""
        for _ in range(3):
            if (pod["metadata"].get("annotations") or {}).get(PLACEMENT_WITHDRAWN) == fence:
                log.warning("placement taken back by another leader; the gate stays", reservation=res.key)
                return
            try:
                await self.kube.merge_patch(
                    path, release_patch(pod, annotations=annotations, node=spec.node_name)
                )
                return
            except ApiError as exc:
                if exc.not_found:
                    return  # deleted meanwhile: the reconciler releases its booking
                if not exc.conflict:
                    raise
            pod = await self.kube.get(path)
            if not gated(pod):
                return

    async def _write_positions(
        self, queued: dict[str, tuple[GpuReservation, Obj]], positions: dict[str, int], *, now: float
    ) -> None:
        hold = self.hold
        shown = self.settings.queue_positions_shown
        for key, position in positions.items():
            res, pod = queued[key]
            waits = f"{QUEUE_MESSAGE_START} {res.spec.memory_mib} MiB of GPU memory"
            if position <= shown:
                written: int | None = position
                message = f"{waits}: position {position} in the queue"
            else:  # its place, written on every placement, would cost a write per entry per placement
                written, message = None, f"{waits}: more than {shown} pods are ahead of it in the queue"
            if hold is not None and hold.key == key:
                message += f"; GPU {hold.gpu_uuid} is held for it as memory frees up"
            if res.status.queue_position == written and res.status.message == message:
                continue
            try:
                await self.kube.merge_patch(
                    f"{reservations_path(res.namespace, res.name)}/status",
                    {"status": {"phase": "Queued", "queuePosition": written, "message": message}},
                )
            except ApiError as exc:
                if not (exc.not_found or exc.conflict):
                    raise
                continue
            self.metrics.queue_status_writes.inc()
            if not (res.status.message or "").startswith(QUEUE_MESSAGE_START):  # first seen in the queue:
                # tell the pod's owner
                meta = pod["metadata"]
                await post_event(
                    self.kube,
                    namespace=res.namespace,
                    involved=Involved(
                        api_version="v1",
                        kind="Pod",
                        name=meta["name"],
                        uid=meta["uid"],
                        namespace=res.namespace,
                    ),
                    event=Event(
                        type="Normal",
                        reason="QueuedForGpu",
                        message=f"No GPU has {res.spec.memory_mib} MiB free now; the pod {message}",
                    ),
                    now=now,
                    reporter=self.settings.identity,
                )
