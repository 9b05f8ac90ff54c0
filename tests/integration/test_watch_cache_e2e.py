"""The watch cache against the real API server, where this process's own writes meet events still in
flight and a relist after 410 Gone (issue #30, 1): an older event never replaces this process's newer
write, and a relist keeps the decisions not created yet and the writes newer than the list."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from vramshare.kube.client import Connection, KubeClient, Obj
from vramshare.kube.watch import WatchCache, version
from vramshare_e2e.cluster import ClusterSettings, LocalCluster

pytestmark = pytest.mark.cluster

PATH = "/api/v1/namespaces/default/configmaps"


def step(obj: Obj) -> str:
    return str((obj.get("data") or {}).get("step", ""))


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """A control plane of its own: the relist test restarts its API server."""
    settings = ClusterSettings(
        with_kwok=False, with_prometheus=False, with_scheduler=False, with_controller_manager=False
    )
    with LocalCluster.start(settings=settings) as local:
        yield local


@pytest_asyncio.fixture(loop_scope="function")
async def kube(cluster: LocalCluster) -> AsyncIterator[KubeClient]:
    async with KubeClient(Connection.load(kubeconfig=str(cluster.kubeconfig))) as client:
        yield client


async def written(kube: KubeClient, name: str, steps: int) -> list[Obj]:
    """A ConfigMap created, then patched, `steps` versions in all."""
    made = [await kube.create(PATH, {"metadata": {"name": name}, "data": {"step": "1"}})]
    for n in range(2, steps + 1):
        made.append(await kube.merge_patch(f"{PATH}/{name}", {"data": {"step": str(n)}}))
    return made


@contextlib.asynccontextmanager
async def running(cache: WatchCache[str]) -> AsyncIterator[None]:
    task = asyncio.create_task(cache.run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_an_event_older_than_this_processs_own_write_does_not_replace_it(kube: KubeClient) -> None:
    name = f"stale-{uuid.uuid4().hex[:8]}"
    v1, v2, v3 = await written(kube, name, 3)
    key = f"default/{name}"
    cache: WatchCache[str] = WatchCache(kube, PATH, decode=step)
    # The cache had seen v1 when this process wrote v3 (and put it): v2's and v3's events are still
    # to come, as for a status write in flight while the ledger commits a placement.
    cache.items[key] = "1"
    cache.resource_version = version(v1)
    cache.synced.set()
    cache.put(key, "3", resource_version=v3["metadata"]["resourceVersion"])
    seen: list[str | None] = []
    cache.on_change(lambda k, item, _before: seen.append(item) if k == key else None)
    async with running(cache):
        assert await cache.wait_for(version(v3), timeout_s=10)
    assert version(v2) < version(v3)
    assert cache.items[key] == "3"
    assert "2" not in seen, seen  # before: v2's event put the older version back for a moment
    assert cache.stale_events == 1
    # v3's own event carries the very resourceVersion the write's answer did: not applied again.
    assert (cache.echoes, seen) == (1, []), seen
    await kube.delete(f"{PATH}/{name}")


async def test_a_relist_after_410_keeps_own_decisions_and_newer_writes(
    kube: KubeClient, cluster: LocalCluster
) -> None:
    """A relist after 410 Gone (`watch.py:_list` replaces the items) kept only what the list
    returned: a booking this process had decided but not created yet left its view, and a decision
    made then saw the GPU without it (issue #30, 1a)."""
    listed_name, newer_name = f"listed-{uuid.uuid4().hex[:8]}", f"newer-{uuid.uuid4().hex[:8]}"
    await written(kube, listed_name, 1)
    cache: WatchCache[str] = WatchCache(kube, PATH, decode=step)
    async with running(cache):
        await asyncio.wait_for(cache.synced.wait(), 10)
    # This process decided a booking it has not created yet (put without a resourceVersion).
    cache.put("default/decided-not-created", "pending")
    # The API server restarts: its watch cache starts at the current resourceVersion, so the stream
    # resuming from an older one gets 410 Gone (deterministically; compacting etcd does not do it, as
    # the API server's watch cache still serves that history), and the cache lists again.
    (newer,) = await written(kube, newer_name, 1)
    cluster.stop_component("kube-apiserver")
    cluster.start_component("kube-apiserver")
    async with running(cache):
        await asyncio.wait_for(cache.synced.wait(), 10)  # set again by the relist
        for _ in range(100):
            if cache.relists:
                break
            await asyncio.sleep(0.05)
        assert await cache.wait_for(version(newer), timeout_s=10)
    assert cache.relists == 1
    assert cache.items["default/decided-not-created"] == "pending"  # before: dropped by the relist
    assert cache.items[f"default/{listed_name}"] == "1"
    assert cache.items[f"default/{newer_name}"] == "1"
    # Its object's event ends the pending state: once created, it is the API server's like any other.
    cache.drop("default/decided-not-created")
    assert "default/decided-not-created" not in cache.items
    for n in (listed_name, newer_name):
        await kube.delete(f"{PATH}/{n}")


def active_step(obj: Obj) -> str | None:
    """A follower's conversion: the step of a ConfigMap not labelled inactive (as `active!=false`)."""
    return step(obj) if (obj["metadata"].get("labels") or {}).get("active") != "false" else None


async def test_a_following_cache_holds_what_a_stream_of_its_own_would_across_a_relist(
    kube: KubeClient, cluster: LocalCluster
) -> None:
    """The controller's queue ledger follows its state's stream instead of a label-selected stream of
    its own (issue #45). Checked against the API server's own selector: through creation, a label
    that takes an object out, deletion and a relist after 410 Gone, the follower holds what a cache
    with the selector holds, plus its own decision not created yet."""
    tag = uuid.uuid4().hex[:8]
    source: WatchCache[Obj] = WatchCache(kube, PATH, decode=lambda o: o)
    follower: WatchCache[str] = WatchCache.following(source, convert=active_step)
    selected: WatchCache[str] = WatchCache(kube, PATH, decode=step, label_selector="active!=false")

    def same() -> bool:
        mine = {k: v for k, v in follower.items.items() if tag in k}
        theirs = {k: v for k, v in selected.items.items() if tag in k}
        return mine == {**theirs, f"default/decided-{tag}": "pending"}

    async def write(made: Obj) -> None:
        """Wait for the write in the source; the selected stream gets no event for an object outside
        its selector (its version does not move), so it is given until its items agree."""
        assert await source.wait_for(version(made), timeout_s=10)
        assert follower.resource_version == source.resource_version
        for _ in range(100):
            if same():
                return
            await asyncio.sleep(0.05)
        raise AssertionError((follower.items, selected.items))

    follower.put(f"default/decided-{tag}", "pending")
    async with running(source), running(selected), running(follower):
        await asyncio.wait_for(source.synced.wait(), 10)
        await asyncio.wait_for(selected.synced.wait(), 10)
        await write(await kube.create(PATH, {"metadata": {"name": f"a-{tag}"}, "data": {"step": "1"}}))
        labelled = {"name": f"b-{tag}", "labels": {"active": "false"}}
        await write(await kube.create(PATH, {"metadata": labelled, "data": {"step": "1"}}))
        assert same(), (follower.items, selected.items)
        assert f"default/a-{tag}" in follower.items
        assert f"default/b-{tag}" not in follower.items
        assert f"default/b-{tag}" in source.items
        await write(await kube.merge_patch(f"{PATH}/a-{tag}", {"metadata": {"labels": {"active": "false"}}}))
        await write(await kube.merge_patch(f"{PATH}/b-{tag}", {"metadata": {"labels": {"active": "true"}}}))
        assert same(), (follower.items, selected.items)
        assert f"default/a-{tag}" not in follower.items
        assert follower.items[f"default/b-{tag}"] == "1"
    # The API server restarts while nobody watches: resuming from the old resourceVersion gets 410.
    newer = await kube.create(PATH, {"metadata": {"name": f"c-{tag}"}, "data": {"step": "1"}})
    await kube.delete(f"{PATH}/b-{tag}")
    cluster.stop_component("kube-apiserver")
    cluster.start_component("kube-apiserver")
    relists = source.relists
    async with running(source), running(selected), running(follower):
        for _ in range(200):
            if source.relists > relists and source.synced.is_set() and selected.synced.is_set():
                break
            await asyncio.sleep(0.05)
        assert source.relists == relists + 1
        assert await source.wait_for(version(newer), timeout_s=10)
        assert await selected.wait_for(version(newer), timeout_s=10)
        assert same(), (follower.items, selected.items)
        assert follower.items[f"default/c-{tag}"] == "1"
        assert f"default/b-{tag}" not in follower.items
        assert follower.items[f"default/decided-{tag}"] == "pending"  # kept: the list cannot know it
    for n in ("a", "c"):
        await kube.delete(f"{PATH}/{n}-{tag}")
