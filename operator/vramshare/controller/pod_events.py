"""The pod events the reservation lifecycle reacts to, from the controller's own pod watch.

That watch (ClusterState.pods) is filtered on the API server by the `vramshare.io/reservation` label,
so the controller never receives, decodes or lists the cluster's other pods. kopf's `labels=` filter
would have been applied on the client: with `clusterwide=True` the leader would have listed every pod
of the cluster at each term and decoded every pod event, on the event loop that also renews the Lease
(issue #31).

Events are coalesced per pod (namespace, name and UID): while one is being handled, later events of
the same pod replace each other and only the newest is handled next. A burst of status writes to one
pod costs one reconcile, not one per write, and one pod is never reconciled by two workers at once.
A pod deleted and created again under its name has a new UID, so the old pod's deletion is still
handled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from vramshare.kube.client import Obj
from vramshare.kube.watch import WatchCache

log = structlog.get_logger("vramshare.controller.pods")

Handler = Callable[[Obj, bool], Awaitable[None]]
"""handle(pod, deleted): the pod's newest body (its last one when deleted)."""


class PodEvents:
    def __init__(self, pods: WatchCache[Obj], *, handle: Handler, workers: int = 4) -> None:
        self._handle = handle
        self._workers = workers
        self._latest: dict[tuple[str, str, str], tuple[Obj, bool]] = {}
        """Each pod's newest event not handled yet."""
        self._busy: set[tuple[str, str, str]] = set()
        self._ready: asyncio.Queue[tuple[str, str, str]] = asyncio.Queue()
        self.handled = 0
        self.coalesced = 0
        """Events replaced by a newer one of the same pod before they were handled."""
        pods.on_change(self._changed)

    def _changed(self, _key: str, pod: Obj | None, previous: Obj | None) -> None:
        body, deleted = (previous, True) if pod is None else (pod, False)
        if body is None:
            return
        meta = body.get("metadata") or {}
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""), str(meta.get("uid") or ""))
        if key in self._latest:
            self.coalesced += 1
        elif key not in self._busy:
            self._ready.put_nowait(key)
        self._latest[key] = (body, deleted)

    async def run(self) -> None:
        """Handle events until cancelled."""
        await asyncio.gather(*(self._work() for _ in range(self._workers)))

    async def _work(self) -> None:
        while True:
            key = await self._ready.get()
            event = self._latest.pop(key, None)
            if event is None:
                continue
            self._busy.add(key)
            try:
                await self._handle(*event)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # one pod's failure must not stop the others' events
                # The periodic sweep reconciles it again; log it so a persistent failure is seen.
                log.warning("pod event not handled", pod=f"{key[0]}/{key[1]}", error=str(exc)[:300])
            finally:
                self.handled += 1
                self._busy.discard(key)
                if key in self._latest:  # newer events arrived meanwhile
                    self._ready.put_nowait(key)
