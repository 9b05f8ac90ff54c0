"""Which webhook replicas are up, so that they can share out GPUs that tie (`vramshare.domain.shards`;
issue #31). Two ways:

- `ReplicaEndpoints` (the chart's default): the ready endpoints of the webhook's own Service, as the
  EndpointSlice controller writes them, each named by its pod. Read-only: it needs list and watch on
  EndpointSlices, no write at all, and follows the same readiness the API server routes admission
  requests by (a replica draining for shutdown is not ready, so its peers take its GPUs at once).
- `ReplicaLeases` (opt-in, for replicas not behind a Service's endpoints, e.g. run outside the
  cluster): each replica keeps a Lease of its own, and follows its peers'.

The Leases:

A replica's Lease is `vramshare-webhook-<hash of its identity>` in its namespace, labelled
`vramshare.io/webhook-replica`, renewed every third of its duration (a write every 5 s per replica by
default, against one or more per admission it saves) and deleted on shutdown, so peers deal its GPUs
out at once rather than a lease duration later. A crashed replica's Lease is judged gone once this
replica has not seen it renewed for its duration, by this replica's own clock (client-go's rule): no
two machines' clocks are ever compared. None of this is needed for safety: the ledger token decides
every commit, so a roster that is wrong for a while only costs the conflicts it saves.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable

import structlog

from vramshare.domain.shards import ReplicaRoster
from vramshare.kube.client import ApiError, KubeClient, Obj
from vramshare.kube.resources import format_time_precise
from vramshare.kube.watch import WatchCache

log = structlog.get_logger("vramshare.replicas")

LABEL_WEBHOOK_REPLICA = "vramshare.io/webhook-replica"
CLEAN_UP_AFTER = 4
"""A replica's Lease left unrenewed for this many durations (its replica crashed) is deleted."""
MAX_IDENTITY = 253
"""A Lease's holderIdentity longer than this (or not a string) is not a replica's: it is left out."""


def replica_lease_name(identity: str) -> str:
    """The Lease of the replica `identity`: hashed, since an identity (host name and pid, or a pod's
    name) need not be a valid object name."""
    return "vramshare-webhook-" + hashlib.blake2s(identity.encode(), digest_size=6).hexdigest()


MAX_REPLICAS = 64
"""More ready endpoints than this and the deal is left off: shares of one or two GPUs each buy
nothing, and a Service that large is not vramshare's webhook alone."""


def ready_pods(endpoint_slice: Obj) -> frozenset[str]:
    """The pods named by an EndpointSlice's ready endpoints. `ready` missing counts as ready (the API's
    rule for consumers that do not know it); endpoints that name no pod, or one whose name is not a
    valid one, are left out."""
    out = set()
    for endpoint in endpoint_slice.get("endpoints") or []:
        if not isinstance(endpoint, dict):
            continue
        if (endpoint.get("conditions") or {}).get("ready") is False:
            continue
        target = endpoint.get("targetRef") or {}
        name = target.get("name")
        if target.get("kind") == "Pod" and isinstance(name, str) and 0 < len(name) <= MAX_IDENTITY:
            out.add(name)
    return frozenset(out)


class ReplicaEndpoints:
    """The replicas up: the pods ready behind the webhook's Service (`service` in `namespace`), from
    its EndpointSlices (label kubernetes.io/service-name). A replica's identity must be its pod's
    name (the chart sets VRAMSHARE_IDENTITY from it); a replica that does not find itself among them
    (not ready yet, or draining) deals nothing and keeps its own hashed order."""

    def __init__(
        self,
        kube: KubeClient,
        *,
        namespace: str,
        service: str,
        on_up: Callable[[int], None] = lambda count: None,
    ) -> None:
        self.on_up = on_up
        """Told how many replicas are up whenever that changes (a gauge)."""
        self.cache: WatchCache[frozenset[str]] = WatchCache(
            kube,
            f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices",
            decode=ready_pods,
            label_selector=f"kubernetes.io/service-name={service}",
            name="webhook-endpoints",
        )
        self._up: tuple[str, ...] = ()
        self.cache.on_change(self._observe)

    def up(self) -> tuple[str, ...]:
        """The replicas up now, in name order; called for every decision."""
        return self._up

    def _observe(self, *_: object) -> None:
        # A pod may be listed in two slices for a moment (while the controller moves it): a set.
        names = tuple(sorted(frozenset().union(*self.cache.items.values())))
        up = names if len(names) <= MAX_REPLICAS else ()
        if up != self._up:
            if len(names) > MAX_REPLICAS:
                log.warning("too many webhook endpoints to deal ties among", endpoints=len(names))
            self._up = up
            self.on_up(len(up))

    async def run(self) -> None:
        await self.cache.run()

    async def release(self) -> None:
        """Nothing to give back: the endpoints follow the pod's readiness."""


def _renewal(lease: Obj) -> tuple[str, str] | None:
    """(holder identity, its last renewal) of a replica's Lease; None for one that is not valid."""
    holder = (lease.get("spec") or {}).get("holderIdentity")
    if not isinstance(holder, str) or not holder or len(holder) > MAX_IDENTITY:
        return None
    return holder, str((lease.get("metadata") or {}).get("resourceVersion") or "")


class ReplicaLeases:
    def __init__(
        self,
        kube: KubeClient,
        *,
        namespace: str,
        identity: str,
        lease_s: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        on_up: Callable[[int], None] = lambda count: None,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.identity = identity
        self.lease_s = lease_s
        self.clock = clock
        self.wall_clock = wall_clock
        self.on_up = on_up
        """Told how many replicas are up after each renewal (a gauge)."""
        self.collection = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        self.name = replica_lease_name(identity)
        self.cache: WatchCache[tuple[str, str] | None] = WatchCache(
            kube,
            self.collection,
            decode=_renewal,
            label_selector=LABEL_WEBHOOK_REPLICA,
            name="webhook-replicas",
        )
        self.roster = ReplicaRoster(lease_s=lease_s)
        self.cache.on_change(self._observe)

    def up(self) -> tuple[str, ...]:
        """The replicas up now, this one included once its Lease is seen, in name order. Called for
        every decision: the roster takes the Leases in as their events arrive, not here."""
        return self.roster.up(now=self.clock())

    def _observe(self, *_: object) -> None:
        self.roster.observe(
            {held[0]: held[1] for held in self.cache.items.values() if held is not None}, now=self.clock()
        )

    async def run(self) -> None:
        await asyncio.gather(self.cache.run(), self._hold())

    def _lease(self) -> Obj:
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "labels": {LABEL_WEBHOOK_REPLICA: "true"},
            },
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": max(1, round(self.lease_s)),
                "renewTime": format_time_precise(self.wall_clock()),
            },
        }

    async def renew(self) -> None:
        """Renew this replica's Lease, creating it when it is not there."""
        lease = self._lease()
        try:
            await self.kube.merge_patch(f"{self.collection}/{self.name}", {"spec": lease["spec"]})
        except ApiError as exc:
            if not exc.not_found:
                raise
            await self.kube.create(self.collection, lease)

    async def clean_up(self) -> int:
        """Delete the Leases of replicas gone for `CLEAN_UP_AFTER` durations (crashed, or their pods
        deleted without a shutdown); each only as last seen, so one renewed meanwhile stays."""
        gone = set(self.roster.long_gone(now=self.clock(), after_s=CLEAN_UP_AFTER * self.lease_s))
        deleted = 0
        for key, held in list(self.cache.items.items()):
            if held is None or held[0] not in gone or held[0] == self.identity:
                continue
            try:
                await self.kube.delete(f"{self.collection}/{key.partition('/')[2]}", resource_version=held[1])
                deleted += 1
                log.info("deleted the Lease of a replica gone", replica=held[0], lease=key)
            except ApiError as exc:
                if not (exc.not_found or exc.conflict):
                    raise
        return deleted

    async def _hold(self) -> None:
        failing = False
        while True:
            try:
                await self.renew()
                if failing:
                    log.info("replica lease renewed again", lease=f"{self.namespace}/{self.name}")
                failing = False
            except Exception as exc:  # never die: peers would count this replica gone, nothing worse
                if not failing:
                    log.warning(
                        "replica lease not renewed; peers will deal this replica's GPUs to others",
                        lease=f"{self.namespace}/{self.name}",
                        error=str(exc)[:200],
                    )
                failing = True
            try:
                await self.clean_up()
            except Exception as exc:  # a Lease left behind costs nothing but a line in `kubectl get`
                log.warning("could not delete the Lease of a replica gone", error=str(exc)[:200])
            self.on_up(len(self.up()))
            await asyncio.sleep(self.lease_s / 3)

    async def release(self, *, timeout_s: float = 2.0) -> None:
        """Delete this replica's Lease on shutdown, so peers take its GPUs at once."""
        try:
            await asyncio.wait_for(self.kube.delete(f"{self.collection}/{self.name}"), timeout_s)
        except (ApiError, OSError, TimeoutError) as exc:
            log.info(
                "replica lease left to expire", lease=f"{self.namespace}/{self.name}", error=str(exc)[:200]
            )
