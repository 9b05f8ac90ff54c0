"""Leader election on a coordination.k8s.io Lease, so that of several controller replicas one acts.

All state lives in the API server, so a new leader simply starts reconciling. The leader renews the
Lease every third of its duration; if it cannot renew before the Lease would expire it stops acting and
stands by again, so two replicas never act at once for longer than a renewal.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from vramshare.kube.client import ApiError, KubeClient, Obj
from vramshare.kube.resources import format_time_precise, parse_time

log = structlog.get_logger("vramshare.controller.leader")


class LeadershipLostError(Exception):
    pass


class LeaseElector:
    def __init__(
        self,
        *,
        kube: KubeClient,
        namespace: str,
        name: str,
        identity: str,
        duration_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.kube = kube
        self.path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.duration_s = duration_s
        self.clock = clock
        self._lease: Obj | None = None

    def _spec(self, *, transitions: int, acquired: float | None = None) -> Obj:
        now = self.clock()
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(self.duration_s)),
            "acquireTime": format_time_precise(acquired if acquired is not None else now),
            "renewTime": format_time_precise(now),
            "leaseTransitions": transitions,
        }

    async def try_acquire(self) -> bool:
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
                        "metadata": {"name": self.name, "namespace": self.namespace},
                        "spec": self._spec(transitions=0),
                    },
                )
                return True
            except ApiError as create_exc:
                if create_exc.conflict:
                    return False
                raise
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity")
        renewed = parse_time(spec.get("renewTime")) or 0.0
        expired = renewed + float(spec.get("leaseDurationSeconds") or self.duration_s) < self.clock()
        if holder not in (None, "", self.identity) and not expired:
            return False
        transitions = int(spec.get("leaseTransitions") or 0) + (0 if holder == self.identity else 1)
        try:
            self._lease = await self.kube.replace(
                self.path, {**lease, "spec": self._spec(transitions=transitions)}
            )
        except ApiError as exc:
            if exc.conflict:
                return False
            raise
        if holder != self.identity:
            log.info("took over the lease", previous=holder, lease=f"{self.namespace}/{self.name}")
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
            await asyncio.sleep(max(0.25, self.duration_s / 10))  # take over soon after expiry
        log.info("leading", identity=self.identity)

    async def hold(self) -> None:
        """Renew until renewal fails for a whole lease duration; then raise LeadershipLostError."""
        last_ok = self.clock()
        while True:
            await asyncio.sleep(self.duration_s / 3)
            try:
                assert self._lease is not None
                spec = self._lease["spec"]
                acquired = parse_time(spec.get("acquireTime"))
                self._lease = await self.kube.replace(
                    self.path,
                    {
                        **self._lease,
                        "spec": self._spec(
                            transitions=int(spec.get("leaseTransitions") or 0), acquired=acquired
                        ),
                    },
                )
                last_ok = self.clock()
            except ApiError as exc:
                if exc.conflict:
                    raise LeadershipLostError("the lease was taken by another replica") from exc
                log.warning("lease renewal failed", error=str(exc))
            except Exception as exc:  # network trouble: keep trying until the lease would expire
                log.warning("lease renewal failed", error=str(exc))
            if self.clock() - last_ok > self.duration_s:
                raise LeadershipLostError(f"could not renew the lease for {self.duration_s:g} s")
