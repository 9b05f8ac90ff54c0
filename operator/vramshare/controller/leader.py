"""Leader election on a coordination.k8s.io Lease, so that of several controller replicas one acts.

The semantics are client-go's (k8s.io/client-go/tools/leaderelection):

- **Expiry is observed, never computed from another machine's clock.** A stand-by remembers the Lease
  record it last saw and *when, by its own monotonic clock,* that record last changed; it takes over
  only after seeing no change for the lease duration. The holder's `renewTime` is written for people
  and never compared with the local clock, so clock skew between nodes cannot hand a live Lease over.
- **The renew deadline is shorter than the lease duration.** The leader renews every retry period;
  each attempt is bounded by what is left of the renew deadline, and a leader that has not renewed
  within the deadline steps down, while the Lease still has `duration - deadline` to run before any
  stand-by may take it. Two replicas therefore never act at once, unless a process is frozen longer
  than that margin; the writes they could both make are harmless (see `InventoryLoop`).
- **Release on shutdown.** A leader that stops (SIGTERM, a rolling update) empties `holderIdentity`
  with a 1 s duration, so a stand-by takes over at its next retry instead of a whole duration later.

All state lives in the API server, so a new leader simply starts reconciling.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import structlog

from vramshare.kube.client import ApiError, KubeClient, Obj
from vramshare.kube.resources import LABEL_HEARTBEAT_LEASE, format_time_precise

log = structlog.get_logger("vramshare.controller.leader")

RELEASE_TIMEOUT_S = 2.0


class LeadershipLostError(Exception):
    pass


@dataclass(frozen=True, kw_only=True)
class LeaseTiming:
    """client-go's defaults: a 15 s lease, renewed within 10 s, tried every 2 s."""

    duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0


def _record(spec: Obj) -> tuple[object, ...]:
    """What identifies one renewal of the Lease: any change means its holder is alive."""
    return (
        spec.get("holderIdentity"),
        spec.get("renewTime"),
        spec.get("acquireTime"),
        spec.get("leaseTransitions"),
        spec.get("leaseDurationSeconds"),
    )


class LeaseElector:
    def __init__(
        self,
        *,
        kube: KubeClient,
        namespace: str,
        name: str,
        identity: str,
        timing: LeaseTiming,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        annotations: Callable[[], Mapping[str, str]] = dict,
    ) -> None:
        self.kube = kube
        self.path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.timing = timing
        self.clock = clock
        """Local monotonic time: when a record was observed, how long since the last renewal."""
        self.wall_clock = wall_clock
        """Only for the times written into the Lease, for people to read."""
        self.annotations = annotations
        """Annotations the leader keeps on the Lease, written with each renewal (the inventory
        heartbeat: no write of its own)."""
        self._lease: Obj | None = None
        self._observed: tuple[object, ...] | None = None
        self._observed_at = 0.0

    def _spec(self, *, transitions: int, acquired: str | None = None) -> Obj:
        now = format_time_precise(self.wall_clock())
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(self.timing.duration_s)),
            "acquireTime": acquired or now,
            "renewTime": now,
            "leaseTransitions": transitions,
        }

    def _metadata(self, lease: Obj) -> Obj:
        meta = dict(lease.get("metadata") or {})
        extra = self.annotations()
        if extra:
            meta["annotations"] = {**(meta.get("annotations") or {}), **extra}
            # So that readers who do not know its namespace and name (`vramshare status`) find it.
            meta["labels"] = {**(meta.get("labels") or {}), LABEL_HEARTBEAT_LEASE: "true"}
        return meta

    def _observe(self, lease: Obj) -> None:
        record = _record(lease.get("spec") or {})
        if record != self._observed:
            self._observed, self._observed_at = record, self.clock()

    @property
    def lease(self) -> Obj | None:
        """The Lease as last written or read by this replica."""
        return self._lease

    @property
    def leading(self) -> bool:
        return (
            self._lease is not None and (self._lease.get("spec") or {}).get("holderIdentity") == self.identity
        )

    async def try_acquire(self) -> bool:
        """Take the Lease if it is free, ours, or unchanged for its whole duration by our clock."""
        try:
            lease = await self.kube.get(self.path)
        except ApiError as exc:
            if not exc.not_found:
                raise
            try:
                self._lease = await self.kube.create(
                    f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases",
                    {
                        "apiVersion": "coordination.k8s.io/v1",
                        "kind": "Lease",
                        "metadata": self._metadata(
                            {"metadata": {"name": self.name, "namespace": self.namespace}}
                        ),
                        "spec": self._spec(transitions=0),
                    },
                )
            except ApiError as create_exc:
                if create_exc.conflict:
                    return False
                raise
            self._observe(self._lease)
            return True
        self._observe(lease)
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        duration = float(spec.get("leaseDurationSeconds") or self.timing.duration_s)
        if holder not in ("", self.identity) and self.clock() < self._observed_at + duration:
            return False
        ours = holder == self.identity
        transitions = int(spec.get("leaseTransitions") or 0) + (0 if ours else 1)
        try:
            self._lease = await self.kube.replace(
                self.path,
                {
                    **lease,
                    "metadata": self._metadata(lease),
                    "spec": self._spec(
                        transitions=transitions, acquired=spec.get("acquireTime") if ours else None
                    ),
                },
            )
        except ApiError as exc:
            if exc.conflict:  # another replica got there first
                return False
            raise
        self._observe(self._lease)
        if not ours:
            log.info("took over the lease", previous=holder or None, lease=f"{self.namespace}/{self.name}")
        return True

    async def _try(self) -> bool:
        try:
            return await self.try_acquire()
        except Exception as exc:  # the API server is away: keep trying, quietly
            log.debug("lease not acquired", error=str(exc))
            return False

    async def acquire(self) -> None:
        announced = False
        while not await self._try():
            if not announced:
                log.info(
                    "standing by: another replica holds the lease", lease=f"{self.namespace}/{self.name}"
                )
                announced = True
            await asyncio.sleep(self.timing.retry_period_s)
        log.info("leading", identity=self.identity)

    async def hold(self) -> None:
        """Renew every retry period; raise LeadershipLostError when another replica holds the Lease or
        no renewal succeeded within the renew deadline (each attempt is cut off at the deadline)."""
        renewed = self.clock()
        while True:
            await asyncio.sleep(self.timing.retry_period_s)
            left = renewed + self.timing.renew_deadline_s - self.clock()
            try:
                async with asyncio.timeout(max(0.0, left)):
                    await self._renew()
                renewed = self.clock()
            except LeadershipLostError:
                raise
            except TimeoutError:
                log.warning("lease renewal cut off at the renew deadline")
            except Exception as exc:  # network trouble: keep trying until the deadline
                log.warning("lease renewal failed", error=str(exc))
            if self.clock() - renewed >= self.timing.renew_deadline_s:
                raise LeadershipLostError(
                    f"could not renew the lease within the {self.timing.renew_deadline_s:g} s renew deadline"
                )

    async def _renew(self) -> None:
        assert self._lease is not None
        for _ in range(3):
            spec = self._lease["spec"]
            try:
                self._lease = await self.kube.replace(
                    self.path,
                    {
                        **self._lease,
                        "metadata": self._metadata(self._lease),
                        "spec": self._spec(
                            transitions=int(spec.get("leaseTransitions") or 0),
                            acquired=spec.get("acquireTime"),
                        ),
                    },
                )
                self._observe(self._lease)
                return
            except ApiError as exc:
                if not exc.conflict:
                    raise
            current = await self.kube.get(self.path)  # changed meanwhile: by whom?
            if (current.get("spec") or {}).get("holderIdentity") != self.identity:
                self._lease = None
                raise LeadershipLostError("the lease was taken by another replica")
            self._lease = current

    async def release(self) -> None:
        """Give the Lease up on shutdown, so a stand-by takes over at its next retry (best effort:
        otherwise it expires)."""
        if not self.leading:
            return
        assert self._lease is not None
        spec = self._lease["spec"]
        now = format_time_precise(self.wall_clock())
        released = {
            "holderIdentity": "",
            "leaseDurationSeconds": 1,
            "acquireTime": now,
            "renewTime": now,
            "leaseTransitions": int(spec.get("leaseTransitions") or 0),
        }
        try:
            async with asyncio.timeout(RELEASE_TIMEOUT_S):
                await self.kube.replace(self.path, {**self._lease, "spec": released})
            log.info("released the lease", lease=f"{self.namespace}/{self.name}")
        except (ApiError, OSError, TimeoutError) as exc:
            log.warning("lease not released; it expires", error=str(exc))
        self._lease = None
