"""The controller's pod events come from its own server-side filtered watch (issue #31): each pod's
events are coalesced while it is being handled, deletions carry the pod's last body, and one pod is
never handled by two workers at once."""

from __future__ import annotations

import asyncio
from typing import Any

from vramshare.controller.pod_events import PodEvents
from vramshare.kube.client import Obj
from vramshare.kube.watch import WatchCache


def pod(name: str, uid: str, phase: str) -> Obj:
    return {"metadata": {"namespace": "jobs", "name": name, "uid": uid}, "status": {"phase": phase}}


def cache() -> WatchCache[Obj]:
    # put and drop (what the stream's events go through) need no API server.
    return WatchCache(None, "/api/v1/pods", decode=lambda o: o)  # type: ignore[arg-type]


async def settle(events: PodEvents, handled: int) -> None:
    async with asyncio.timeout(2):
        while events.handled < handled:  # noqa: ASYNC110 (a counter, polled in a test)
            await asyncio.sleep(0.001)


async def test_events_of_a_pod_being_handled_are_coalesced_into_its_newest() -> None:
    pods = cache()
    seen: list[tuple[str, bool]] = []
    gate = asyncio.Event()
    running: set[str] = set()
    overlapped: list[str] = []

    async def handle(body: Obj, deleted: bool) -> None:
        name = body["metadata"]["name"]
        if name in running:
            overlapped.append(name)
        running.add(name)
        await gate.wait()
        seen.append((body["status"]["phase"], deleted))
        running.discard(name)

    events = PodEvents(pods, handle=handle, workers=4)
    worker = asyncio.create_task(events.run())
    pods.put("jobs/a", pod("a", "u1", "Pending"), resource_version=1)
    await asyncio.sleep(0.01)  # the first event is being handled
    for rv, phase in enumerate(("Running", "Running", "Succeeded"), start=2):
        pods.put("jobs/a", pod("a", "u1", phase), resource_version=rv)
    gate.set()
    await settle(events, 2)
    worker.cancel()
    assert seen == [("Pending", False), ("Succeeded", False)]
    assert events.coalesced == 2
    assert overlapped == []


async def test_a_deletion_carries_the_pods_last_body_and_a_new_uid_is_another_pod() -> None:
    pods = cache()
    seen: list[tuple[str, str, bool]] = []

    async def handle(body: Obj, deleted: bool) -> None:
        seen.append((body["metadata"]["uid"], body["status"]["phase"], deleted))

    events = PodEvents(pods, handle=handle)
    worker = asyncio.create_task(events.run())
    pods.put("jobs/a", pod("a", "u1", "Running"), resource_version=1)
    await settle(events, 1)
    pods.drop("jobs/a")
    # Created again under the same name before the deletion was handled: both are handled.
    pods.put("jobs/a", pod("a", "u2", "Pending"), resource_version=3)
    await settle(events, 3)
    worker.cancel()
    assert seen == [("u1", "Running", False), ("u1", "Running", True), ("u2", "Pending", False)]


async def test_a_failing_pod_does_not_stop_the_others() -> None:
    pods = cache()
    seen: list[str] = []

    async def handle(body: Obj, _deleted: bool) -> Any:
        if body["metadata"]["name"] == "bad":
            raise RuntimeError("the API server said no")
        seen.append(body["metadata"]["name"])

    events = PodEvents(pods, handle=handle, workers=1)
    worker = asyncio.create_task(events.run())
    pods.put("jobs/bad", pod("bad", "u1", "Running"), resource_version=1)
    pods.put("jobs/good", pod("good", "u2", "Running"), resource_version=2)
    await settle(events, 2)
    worker.cancel()
    assert seen == ["good"]
