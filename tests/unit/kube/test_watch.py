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


async def test_the_echo_of_this_processs_own_write_is_not_decoded_or_told_again() -> None:
    """The API server's answer to a write is put at once; the same version's event, when it comes, is
    that very object: decoding it and telling the listeners again (the ledger index) was work for
    nothing. A later version of it is applied as usual."""
    kube = FakeKube()
    decoded: list[str] = []

    def decode(obj: Obj) -> str:
        decoded.append(name(obj))
        return f"{name(obj)}@{obj['metadata']['resourceVersion']}"

    cache: WatchCache[str] = WatchCache(kube, PATH, decode=decode)  # type: ignore[arg-type]
    told: list[str | None] = []
    cache.on_change(lambda _key, item, _before: told.append(item))
    task = asyncio.create_task(cache.run())
    try:
        await asyncio.wait_for(cache.synced.wait(), 2)
        written = await kube.create(PATH, {"metadata": {"name": "mine"}})
        version = written["metadata"]["resourceVersion"]
        cache.put("/mine", f"mine@{version}", resource_version=version)
        await kube.create(PATH, {"metadata": {"name": "theirs"}})
        assert await cache.wait_for(kube.version, timeout_s=2)
        assert (decoded, cache.echoes) == (["theirs"], 1)
        assert told == [f"mine@{version}", f"theirs@{kube.version}"]
        changed = await kube.merge_patch(f"{PATH}/mine", {"metadata": {"labels": {"a": "b"}}})
        assert await cache.wait_for(kube.version, timeout_s=2)
        assert cache.items["/mine"] == f"mine@{changed['metadata']['resourceVersion']}"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
