"""WatchCache against a fake client: list then watch, resume after a broken stream, relist on 410."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.unit.fake_kube import FakeKube
from vramshare.kube.client import ApiError, Obj
from vramshare.kube.watch import WatchCache

PATH = "/api/v1/nodes"


def name(obj: Obj) -> str:
    return str(obj["metadata"]["name"])


@contextlib.asynccontextmanager
async def running(cache: WatchCache[Any]) -> AsyncIterator[asyncio.Task[None]]:
    """`cache.run()` as a task for the block, cancelled after it."""
    task = asyncio.create_task(cache.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_list_then_follow_the_stream() -> None:
    kube = FakeKube()
    await kube.create(PATH, {"metadata": {"name": "a"}})
    cache: WatchCache[str] = WatchCache(kube, PATH, decode=name)  # type: ignore[arg-type]
    async with running(cache):
        await asyncio.wait_for(cache.synced.wait(), 2)
        assert set(cache.items.values()) == {"a"}
        await kube.create(PATH, {"metadata": {"name": "b"}})
        await kube.delete(f"{PATH}/a")
        assert await cache.wait_for(kube.version, timeout_s=2)
        assert set(cache.items.values()) == {"b"}
        assert cache.streaming


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
    async with running(cache):
        await asyncio.wait_for(cache.synced.wait(), 2)
        await kube.create(PATH, {"metadata": {"name": "b"}})
        assert await cache.wait_for(kube.version, timeout_s=3)
        assert set(cache.items.values()) == {"a", "b"}
        assert cache.relists == 1
        assert sum(op == "list" for op, _ in kube.calls) == 2  # the first list, and the one after 410


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
    async with running(cache):
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


async def test_a_following_cache_is_fed_by_one_stream_decoded_once() -> None:
    """The controller's state and its queue's ledger keep the same objects in two forms: the second
    copy follows the first's stream (one list, one watch, each event decoded once), converted, with
    what its conversion leaves out absent (as a label selector's watch would say DELETED)."""
    kube = FakeKube()
    await kube.create(PATH, {"metadata": {"name": "a", "labels": {"active": "true"}}})
    decoded: list[str] = []

    def decode(obj: Obj) -> Obj:
        decoded.append(name(obj))
        return obj

    source: WatchCache[Obj] = WatchCache(kube, PATH, decode=decode)  # type: ignore[arg-type]
    copy: WatchCache[str] = WatchCache.following(
        source, convert=lambda o: name(o) if o["metadata"]["labels"].get("active") == "true" else None
    )
    told: list[tuple[str, str | None]] = []
    copy.on_change(lambda key, item, _before: told.append((key, item)))
    async with running(copy) as copy_run, running(source):
        await asyncio.wait_for(copy.synced.wait(), 2)
        assert copy.items == {"/a": "a"}
        await kube.create(PATH, {"metadata": {"name": "b", "labels": {"active": "false"}}})
        await kube.merge_patch(f"{PATH}/a", {"metadata": {"labels": {"active": "false"}}})
        await kube.merge_patch(f"{PATH}/b", {"metadata": {"labels": {"active": "true"}}})
        await kube.delete(f"{PATH}/b")
        assert await copy.wait_for(kube.version, timeout_s=2)
        assert copy.resource_version == source.resource_version == kube.version
        assert told == [("/a", "a"), ("/a", None), ("/b", "b"), ("/b", None)]
        assert copy.items == {}
        assert set(source.items) == {"/a"}
        assert decoded == ["a", "b", "a", "b"]  # once per object state, for both copies
        assert [op for op, _ in kube.calls if op in ("list", "watch")] == ["list", "watch"]
        assert not copy_run.done()  # it waits for the source's stream; it has none of its own


async def test_a_following_caches_own_writes_stay_its_own_and_survive_a_relist() -> None:
    """Each copy applies the stream by the rules of its own items: a decision the follower put (not
    created yet) stays across the source's relist after 410 Gone; an event older than the follower's
    own write of an object does not replace it, though the source takes it; the source's own writes
    are not the follower's until their events come."""
    kube = FakeKube()
    await kube.create(PATH, {"metadata": {"name": "mine"}})
    gone = [ApiError(status=410, reason="Gone", message="too old resource version")]
    kube.fail = lambda op, path: gone.pop(0) if op == "watch" and gone else None
    source: WatchCache[str] = WatchCache(
        kube, PATH, decode=lambda o: f"{name(o)}@{o['metadata']['resourceVersion']}"
    )
    copy: WatchCache[str] = WatchCache.following(source, convert=lambda item: item)
    copy.put("/decided", "decided")  # this process's decision, its object not created yet
    async with running(source):
        await asyncio.wait_for(source.synced.wait(), 2)
        async with asyncio.timeout(2):
            # The relist (its first watch answered 410) has no event of its own to wait on.
            while source.relists == 0 or not source.streaming:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        assert copy.items == {"/decided": "decided", "/mine": "mine@1"}
        # Two writes before the stream brings either; the copy wrote the second itself.
        await kube.merge_patch(f"{PATH}/mine", {"metadata": {"labels": {"a": "b"}}})
        newer = await kube.merge_patch(f"{PATH}/mine", {"metadata": {"labels": {"a": "c"}}})
        copy.put("/mine", "mine (own write)", resource_version=newer["metadata"]["resourceVersion"])
        source.put("/theirs", "theirs (the source's decision)")
        assert "/theirs" not in copy.items
        assert await copy.wait_for(kube.version, timeout_s=2)
        assert copy.items["/mine"] == "mine (own write)"
        assert (copy.stale_events, copy.echoes) == (1, 1)
        assert source.items["/mine"] == f"mine@{newer['metadata']['resourceVersion']}"
        assert copy.items["/decided"] == "decided"


async def test_a_cache_is_followed_from_its_first_list_and_keeps_the_streams_version() -> None:
    kube = FakeKube()
    source: WatchCache[str] = WatchCache(kube, PATH, decode=name)  # type: ignore[arg-type]
    copy: WatchCache[str] = WatchCache.following(source, convert=lambda item: item)
    with pytest.raises(RuntimeError, match="follows"):
        copy.resource_version = 7
    with pytest.raises(ValueError, match="not a follower"):
        WatchCache.following(copy, convert=lambda item: item)
    async with running(source):
        await asyncio.wait_for(source.synced.wait(), 2)
        with pytest.raises(ValueError, match="followed before it lists"):
            WatchCache.following(source, convert=lambda item: item)
