"""`vramshare-controller`: keep the GPU inventory and the reservation lifecycle (settings from
VRAMSHARE_* environment variables). Several replicas may run; the one holding the Lease acts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Coroutine
from functools import partial
from typing import Any

import kopf
import structlog
from kopf._core.engines.peering import Identity  # kopf exports no public name for it
from prometheus_client import start_http_server

from vramshare import logs
from vramshare.airflow_pools import AirflowPools
from vramshare.controller.devices import InventoryLoop
from vramshare.controller.leader import LeadershipLostError, LeaseElector
from vramshare.controller.metrics import ControllerMetrics
from vramshare.controller.pod_events import PodEvents
from vramshare.controller.pools import PoolSync
from vramshare.controller.queue import QueueLoop
from vramshare.controller.reservations import ReservationReconciler
from vramshare.controller.settings import ControllerSettings
from vramshare.controller.state import ClusterState
from vramshare.domain.freshness import InventoryHeartbeat
from vramshare.kube.client import Connection, KubeClient, Obj
from vramshare.kube.heartbeat import ANNOTATION_HEARTBEAT, encode
from vramshare.kube.lease_watch import HeartbeatSource, logged_heartbeat
from vramshare.kube.ledger import FollowedStreams, KubeLedger
from vramshare.kube.objects import GpuReservation
from vramshare.prometheus import DcgmSource
from vramshare.settings import SettingsError

log = structlog.get_logger("vramshare.controller")


def kopf_registry() -> kopf.OperatorRegistry:
    """kopf runs the leader's term (its settings, its login, SIGTERM). The events of reservations and
    pods come from the controller's own watch caches (`ClusterState`), decoded once: kopf's
    cluster-wide reservation watch was a third stream of the same objects beside the state's and the
    queue's, each event decoded and handled again, and a third watcher for the API server to feed
    (issue #31). kopf's pod label filters are applied on the client, hence `PodEvents`."""
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.enabled = False  # vramshare posts its own, worded events
        settings.watching.server_timeout = 300

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> Any:
        # With a kubeconfig named in the settings, read it now: the kubernetes client fixed its
        # default path ($KUBECONFIG) when it was imported, before main() set the variable, so its
        # loader found no configuration and kopf never logged in (its handlers never ran).
        if os.environ.get("KUBECONFIG"):
            return kopf.login_with_kubeconfig(**kwargs)
        return kopf.login_via_client(**kwargs)

    return registry


def newest_heartbeat(inventory: InventoryLoop, elector: LeaseElector) -> InventoryHeartbeat | None:
    """This leader's last heartbeat; before its first poll, the one the last leader left on the Lease."""
    return inventory.heartbeat or logged_heartbeat(elector.lease or {})


async def run(settings: ControllerSettings) -> None:
    metrics = ControllerMetrics()
    start_http_server(settings.metrics_port, addr=settings.metrics_host, registry=metrics.registry)
    connection = Connection.load(kubeconfig=settings.kubeconfig or None)
    async with KubeClient(connection, user_agent="vramshare-controller") as kube:
        published: dict[str, str] = {}
        """The inventory heartbeat, carried on the Lease by every renewal."""
        elector = LeaseElector(
            kube=kube,
            namespace=settings.namespace,
            name=settings.lease_name,
            identity=settings.identity,
            timing=settings.lease,
            annotations=lambda: published,
        )

        def publish(heartbeat: InventoryHeartbeat) -> None:
            """Carried on the Lease from its next renewal on."""
            published[ANNOTATION_HEARTBEAT] = encode(heartbeat)

        source = DcgmSource(
            url=settings.prometheus_url,
            node_label=settings.node_label,
            selector=settings.metrics_selector,
            query_delay_s=settings.prometheus_query_delay_s,
            access=settings.prometheus_access,
        )
        # Lead while holding the Lease; on losing it (no renewal within the renew deadline, or another
        # replica took over), stop acting and stand by again, without a restart. On shutdown (SIGTERM)
        # the loops stop first, then the Lease is released, so a stand-by takes over at once.
        try:
            while True:
                await elector.acquire()
                metrics.leader.set(1)
                try:
                    state = ClusterState(kube, namespace=settings.namespace)
                    inventory = InventoryLoop(
                        kube=kube,
                        source=source,
                        settings=settings,
                        metrics=metrics,
                        state=state,
                        on_heartbeat=publish,
                    )
                    # The queue's decisions date unchanged GPUs by the heartbeat too.
                    ledger = KubeLedger(
                        kube,
                        heartbeat=HeartbeatSource(partial(newest_heartbeat, inventory, elector)),
                        # Its bookings counted from their pods' starts, from the state's pod watch.
                        pods=state.pods_by_label,
                        # Its devices and bookings from the state's streams: one watch of each kind.
                        follow=FollowedStreams(devices=state.devices, reservations=state.reservations),
                    )
                    pools = (
                        PoolSync(
                            settings=settings,
                            inventory=inventory,
                            pools=AirflowPools(settings.airflow_access),
                            metrics=metrics,
                        )
                        if settings.airflow_url
                        else None
                    )
                    await lead(
                        state,
                        inventory,
                        # Bookings' ages on the API server's clock, which stamped their creation.
                        ReservationReconciler(
                            kube=kube,
                            settings=settings,
                            metrics=metrics,
                            state=state,
                            clock=kube.server_clock.now,
                        ),
                        QueueLoop(kube=kube, ledger=ledger, state=state, settings=settings, metrics=metrics),
                        elector,
                        pools=pools,
                    )
                except LeadershipLostError as exc:
                    log.warning("stepped down: leadership lost", error=str(exc))
                except ShutdownRequestedError:
                    log.info("stopping: a signal was received")
                    return
                finally:
                    metrics.step_down()
        finally:
            await elector.release()


class ShutdownRequestedError(Exception):
    """SIGTERM or SIGINT arrived while leading."""


async def lead(
    state: ClusterState,
    inventory: InventoryLoop,
    reconciler: ReservationReconciler,
    queue: QueueLoop,
    elector: LeaseElector,
    *,
    pools: PoolSync | None = None,
) -> None:
    """Run the leader's loops over the watch-fed state (and kopf) until one ends;
    re-raise why (LeadershipLostError above all). `pools`: the optional Airflow pool sync."""
    stop = asyncio.Event()

    async def pod_changed(pod: Obj, deleted: bool) -> None:
        await reconciler.pod_changed(pod, deleted=deleted, presence=inventory.presence)
        queue.wake()

    pod_events = PodEvents(state.pods, handle=pod_changed)

    # Every reservation, as the state's watch brings it (its first list included), so that a booking
    # whose pod never appears is looked at again the moment its TTL runs out (not at the next sweep),
    # and a deleted one goes the moment its pod is gone; any change may let the queue place its head.
    def reservation_changed(_key: str, res: GpuReservation | None, _previous: GpuReservation | None) -> None:
        if res is not None:
            reconciler.reservation_changed(res, presence=lambda: inventory.presence)
        queue.wake()

    state.reservations.on_change(reservation_changed)

    async def loops() -> None:
        await state.wait_synced()
        log.info(
            "state synced",
            gpus=len(state.devices.items),
            reservations=len(state.reservations.items),
            pods=len(state.pods.items),
        )
        await queue.ledger.devices.synced.wait()
        await queue.ledger.reservations.synced.wait()
        await asyncio.gather(
            inventory.run(),
            reconciler.run(presence=lambda: inventory.presence),
            queue.run(),
            *([pools.run()] if pools is not None else []),
        )

    tasks = [
        asyncio.create_task(elector.hold(), name="lease"),
        asyncio.create_task(state.run(), name="state"),
        asyncio.create_task(pod_events.run(), name="pod-events"),
        asyncio.create_task(queue.ledger.run(), name="ledger"),
        asyncio.create_task(loops(), name="loops"),
        asyncio.create_task(
            kopf.operator(
                registry=kopf_registry(),
                # Our own name: kopf would otherwise make one with getpass.getuser(), which fails for
                # a uid the image's /etc/passwd lacks (as restricted pods often run).
                identity=Identity(elector.identity),
                standalone=True,
                clusterwide=True,
                stop_flag=stop,
            ),
            name="kopf",
        ),
    ]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()
            if task.get_name() == "kopf" and not stop.is_set():
                # kopf takes SIGTERM/SIGINT over while it runs, and stops on them.
                raise ShutdownRequestedError
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def main() -> None:
    try:
        settings = ControllerSettings.from_env()
    except SettingsError as exc:
        print(f"vramshare-controller: {exc}", file=sys.stderr)
        sys.exit(2)
    logs.configure(level=settings.log_level)
    logging.getLogger("kopf").setLevel(logging.WARNING)
    if settings.kubeconfig:
        os.environ["KUBECONFIG"] = settings.kubeconfig  # for kopf's login through the kubernetes client
    with contextlib.suppress(KeyboardInterrupt, asyncio.CancelledError):
        asyncio.run(_until_stopped(run(settings)))


async def _until_stopped(work: Coroutine[Any, Any, None]) -> None:
    """Run `work`; SIGTERM or SIGINT cancel it, so its cleanup (the Lease's release) runs."""
    task = asyncio.ensure_future(work)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        log.info("stopped")


if __name__ == "__main__":
    main()
