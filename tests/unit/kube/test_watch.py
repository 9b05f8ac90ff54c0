"""WatchCache against a fake client: list then watch, resume after a broken stream, relist on 410."""

from __future__ import annotations

import asyncio
import contextlib

from tests.unit.fake_kube import FakeKube
from vramshare.kube.client import ApiError, Obj
from vramshare.kube.watch import WatchCache

PATH = "/api/v1/nodes"


def name(obj: Obj) -> str:
    return str(obj["metadata"]["name"])


async def test_list_then_follow_the_stream() -> None:
    kube = FakeKube()
    await kube.create(PATH, {"metadata": {"name": "a"}})
    cache: WatchCache[str] = WatchCache(kube, PATH, decode=name)  # type: ignore[arg-type]
    task = asyncio.create_task(cache.run())
    try:
        await asyncio.wait_for(cache.synced.wait(), 2)
        assert set(cache.items.values()) == {"a"}
        await kube.create(PATH, {"metadata": {"name": "b"}})
        await kube.delete(f"{PATH}/a")
        assert await cache.wait_for(kube.version, timeout_s=2)
        assert set(cache.items.values()) == {"b"}
        assert cache.streaming
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_broken_stream_resumes_and_a_410_lists_again() -> None:
    kube = FakeKube()
    await kube.create(PATH, {"metadata": {"name": "a"}})
    failures: list[BaseException] = [
        ConnectionError("the API server went away"),
        ApiError(status=410, reason="Gone", message="too old resource version"),
    ]

    def flaky(op: str, path: str) -> BaseException | None:
        return failures.pop(0) if op == "watch" and failures else None

    kube.fail = flaky
    cache: WatchCache[str] = WatchCache(kube, PATH, decode=name)  # type: ignore[arg-type]
    task = asyncio.create_task(cache.run())
    try:
        await asyncio.wait_for(cache.synced.wait(), 2)
        await kube.create(PATH, {"metadata": {"name": "b"}})
        assert await cache.wait_for(kube.version, timeout_s=3)
        assert set(cache.items.values()) == {"a", "b"}
        assert cache.relists == 1
        assert sum(op == "list" for op, _ in kube.calls) == 2  # the first list, and the one after 410
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
