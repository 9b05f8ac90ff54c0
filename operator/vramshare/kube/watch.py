"""An in-memory copy of one kind of object, fed by LIST then WATCH: what decisions read instead of a
LIST per request.

The loop lists (in pages), then watches from the list's resourceVersion with bookmarks. A broken
stream resumes from the last resourceVersion seen; a 410 Gone (the API server no longer has that
history) lists again. `resource_version` only ever advances from the stream (list, events,
bookmarks), so "the cache has every event up to `resource_version`" holds at all times: that is what
the ledger's safety argument rests on (see vramshare.kube.ledger). Objects are decoded once, when they
arrive, not at every decision.

This process's own writes go in with `put` before their events arrive, and two rules keep them:

- an item is never replaced by an older version of itself: an event still in flight from before
  this process's write (a status write's MODIFIED) does not undo the write (each item's
  resourceVersion is kept; an object's resourceVersions grow with every write, being etcd's
  revisions);
- a relist (after 410 Gone) keeps what it cannot know yet: this process's decisions not created yet
  (`put` without a resourceVersion) and items newer than the list. The watch from the list's
  resourceVersion then brings their events.

**One stream, several copies** (`WatchCache.following`). A process that needs the same objects twice,
in two forms (the controller's state keeps every GpuReservation; its queue's ledger keeps the active
ones as bookings, with its own decisions put in), follows one stream with a second cache instead of
opening a second one: each event is received and decoded once, and handed to every copy, converted.
Each copy applies it by the rules above against its own items (its own writes stay its own), and
shares the stream's `resource_version`, `synced` and `streaming`: "every event up to
`resource_version` is applied" holds for it as for the stream's own copy, since an event reaches every
copy before the version moves past it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import structlog

from vramshare.kube.client import ApiError, KubeClient, Obj

log = structlog.get_logger("vramshare.watch")

T = TypeVar("T")
S = TypeVar("S")

PAGE = 5000


def version(obj: Obj) -> int:
    """An object's resourceVersion as a number (etcd's revision; 0 when absent)."""
    raw = (obj.get("metadata") or {}).get("resourceVersion") or "0"
    try:
        return int(raw)
    except ValueError:
        return 0


def key_of(obj: Obj) -> str:
    meta = obj["metadata"]
    return f"{meta.get('namespace') or ''}/{meta['name']}"


class WatchCache(Generic[T]):
    def __init__(
        self,
        kube: KubeClient,
        path: str,
        *,
        decode: Callable[[Obj], T],
        label_selector: str | None = None,
        field_selector: str | None = None,
        name: str = "",
        watch_timeout_s: int = 300,
    ) -> None:
        self.kube = kube
        self.path = path
        self.decode = decode
        self.label_selector = label_selector
        self.field_selector = field_selector
        self.name = name or path
        self.watch_timeout_s = watch_timeout_s
        self.items: dict[str, T] = {}
        self._versions: dict[str, int] = {}
        """Each item's resourceVersion as applied."""
        self._own_pending: set[str] = set()
        """Items this process `put` without a resourceVersion (decided, not created yet)."""
        self.stale_events = 0
        """Events that were older than the item already held (and so not applied)."""
        self.echoes = 0
        """Events of the very version already held: this process's own write, `put` from the API
        server's answer before its event came (not decoded or told again)."""
        self._resource_version = 0
        self._synced = asyncio.Event()
        self._streaming = False
        self.relists = 0
        self._progress = asyncio.Condition()
        self._on_change: list[Callable[[str, T | None, T | None], None]] = []
        self._source: WatchCache[Any] | None = None
        """The cache whose stream feeds this one (`following`); None: this cache runs its own."""
        self._followers: list[_Follower[T, Any]] = []
        """Caches fed by this one's stream, each with how an item is converted for it."""

    @classmethod
    def following(
        cls, source: WatchCache[S], *, convert: Callable[[S], T | None], name: str = ""
    ) -> WatchCache[T]:
        """A second copy of `source`'s objects, fed by its stream (see the module docstring): each item
        as `convert` makes it of the source's decoded item, None leaving it out (as a label selector
        would). `source`'s owner runs the stream; this copy's `run` only waits. Made before the source
        lists, so that the copy's callbacks see every item."""
        cache: WatchCache[T] = cls(
            source.kube,
            source.path,
            decode=_never_decoded,
            label_selector=source.label_selector,
            field_selector=source.field_selector,
            name=name or f"{source.name} (followed)",
        )
        if source.items or source.synced.is_set() or source._source is not None:
            # Its copy would start without what the source holds, unseen by the callbacks its owner
            # registers next: follow a stream from its first list.
            raise ValueError(f"{source.name}: a cache is followed before it lists, and not a follower")
        cache._source = source
        source._followers.append(_Follower(cache=cache, convert=convert))
        return cache

    @property
    def resource_version(self) -> int:
        """Every event up to this resourceVersion is applied (advanced by the stream only)."""
        return self._source.resource_version if self._source is not None else self._resource_version

    @resource_version.setter
    def resource_version(self, value: int) -> None:
        if self._source is not None:
            raise RuntimeError(f"{self.name} follows {self._source.name}: its version is the stream's")
        self._resource_version = value

    @property
    def synced(self) -> asyncio.Event:
        return self._source.synced if self._source is not None else self._synced

    @property
    def streaming(self) -> bool:
        """True while a watch stream is open: the cache follows the API server live."""
        return self._source.streaming if self._source is not None else self._streaming

    @property
    def newest_version(self) -> int:
        """The newest resourceVersion this cache holds: the stream's, or a write of this process's own
        that is ahead of it."""
        return max(self.resource_version, max(self._versions.values(), default=0))

    def on_change(self, callback: Callable[[str, T | None, T | None], None]) -> None:
        """Call `callback(key, item or None when deleted, the item before)` for every change."""
        self._on_change.append(callback)

    async def run(self) -> None:
        """List, then watch until cancelled; never returns otherwise. A cache that follows another's
        stream waits until cancelled (the stream is run by its owner)."""
        if self._source is not None:
            await asyncio.Event().wait()
        backoff = 0.2
        while True:
            try:
                if not self.synced.is_set() or self.resource_version == 0:
                    await self._list()
                await self._watch()
                backoff = 0.2
            except _GoneError:
                self._gone()
            except ApiError as exc:
                if exc.status == 410:
                    self._gone()
                    continue
                log.warning("watch interrupted; resuming", cache=self.name, error=str(exc)[:200])
                await asyncio.sleep(backoff)
                backoff = min(5.0, backoff * 2)
            except Exception as exc:  # never die: a cache that stops following would decide on old data
                log.warning("watch interrupted; resuming", cache=self.name, error=str(exc)[:200])
                await asyncio.sleep(backoff)
                backoff = min(5.0, backoff * 2)
            finally:
                self._streaming = False

    def _gone(self) -> None:
        self.relists += 1
        log.info("watch history expired: listing again", cache=self.name)
        self.synced.clear()

    async def _list(self) -> None:
        items: dict[str, T] = {}
        versions: dict[str, int] = {}
        token: str | None = None
        listed_version = "0"
        while True:
            page = await self.kube.list(
                self.path,
                label_selector=self.label_selector,
                field_selector=self.field_selector,
                limit=PAGE,
                continue_token=token,
            )
            for obj in page.get("items", []):
                items[key_of(obj)] = self.decode(obj)
                versions[key_of(obj)] = version(obj)
            meta = page.get("metadata") or {}
            listed_version = meta.get("resourceVersion") or listed_version
            token = meta.get("continue")
            if not token:
                break
        listed = int(listed_version)
        self._resource_version = listed  # before anyone is told: a listener reads the list's version
        for follower in self._followers:
            converted = {k: c for k, item in items.items() if (c := follower.convert(item)) is not None}
            follower.cache._take_list(converted, {k: versions[k] for k in converted}, listed)
        self._take_list(items, versions, listed)
        self._synced.set()
        await self._advance()

    def _take_list(self, items: dict[str, T], versions: dict[str, int], listed: int) -> None:
        """Replace this copy's items by a list's, keeping what the list cannot know: this process's own
        decisions not created yet, and items newer than the list (written, by this process, after the
        list's snapshot)."""
        server = set(items)
        for key, item in self.items.items():
            newer = self._versions.get(key, 0) > max(listed, versions.get(key, 0))
            if (key in self._own_pending and key not in items) or newer:
                items[key] = item
                versions[key] = self._versions.get(key, 0)
        before = self.items
        self.items = items
        self._versions = versions
        self._own_pending = {k for k in self._own_pending if k in items and k not in server}
        for key in set(before) - set(items):
            self._notify(key, None, before[key])
        for key, item in items.items():
            self._notify(key, item, before.get(key))

    async def _watch(self) -> None:
        self._streaming = True
        async for event in self.kube.watch(
            self.path,
            resource_version=str(self._resource_version),
            label_selector=self.label_selector,
            field_selector=self.field_selector,
            timeout_s=self.watch_timeout_s,
        ):
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                if obj.get("code") == 410:
                    raise _GoneError
                raise ApiError(
                    status=int(obj.get("code") or 500),
                    reason=str(obj.get("reason", "")),
                    message=str(obj.get("message", "")),
                )
            if kind in ("ADDED", "MODIFIED"):
                key, at = key_of(obj), version(obj)
                mine = self._wants(key, at)
                takers = [f for f in self._followers if f.cache._wants(key, at)]
                if mine or takers:
                    item = self.decode(obj)  # once, for every copy that takes it
                    # The followers first (here and below), so this copy's listeners find them current.
                    for follower in takers:
                        follower.take(key, item, at)
                    if mine:
                        self._take(key, item, at)
            elif kind == "DELETED":
                key = key_of(obj)
                for follower in self._followers:
                    follower.cache._take_deletion(key)
                self._take_deletion(key, tell_if_unknown=True)
            self._resource_version = max(self._resource_version, version(obj))
            await self._advance()

    def _wants(self, key: str, at: int) -> bool:
        """Whether an event of `key` at resourceVersion `at` changes this copy (counted if not)."""
        held = self._versions.get(key, 0)
        if at and at < held:
            self.stale_events += 1  # older than this process's own write of it
            return False
        if at and at == held and key in self.items:
            # A resourceVersion names one state of the object: the one this process wrote and put
            # already. The webhooks' own bookings and token bumps came back as events and were decoded
            # and counted again (issue #45).
            self.echoes += 1
            return False
        return True

    def _take(self, key: str, item: T, at: int) -> None:
        previous = self.items.get(key)
        self.items[key] = item
        self._versions[key] = at
        self._own_pending.discard(key)
        self._notify(key, item, previous)

    def _take_deletion(self, key: str, *, tell_if_unknown: bool = False) -> None:
        previous = self.items.pop(key, None)
        self._versions.pop(key, None)
        self._own_pending.discard(key)
        if previous is not None or tell_if_unknown:
            self._notify(key, None, previous)

    def _notify(self, key: str, item: T | None, previous: T | None) -> None:
        for callback in self._on_change:
            callback(key, item, previous)

    async def _advance(self) -> None:
        async with self._progress:
            self._progress.notify_all()

    async def wait_for(self, resource_version: int, *, timeout_s: float) -> bool:
        """Wait until the stream has passed `resource_version`; False if it did not within the time."""
        if self._source is not None:
            return await self._source.wait_for(resource_version, timeout_s=timeout_s)
        if self._resource_version >= resource_version:
            return True
        try:
            async with asyncio.timeout(timeout_s), self._progress:
                await self._progress.wait_for(lambda: self._resource_version >= resource_version)
        except TimeoutError:
            return False
        return True

    def put(self, key: str, item: T, *, resource_version: int | str | None = None) -> None:
        """This process's own write, known before its event arrives: `resource_version` is the
        written object's (the events of older versions then never replace it); without one, a
        decision not created yet, kept across relists until its object's event or `drop`. Only this copy
        takes it: the copies following this one take the object's event when it comes, as a cache of
        their own would (a copy's own writes stay its own)."""
        written = int(resource_version or 0)
        if written and written < self._versions.get(key, 0):
            return  # the cache already holds a newer version (its event came first)
        previous = self.items.get(key)
        self.items[key] = item
        if written:
            self._versions[key] = written
            self._own_pending.discard(key)
        else:
            self._own_pending.add(key)
        self._notify(key, item, previous)

    def drop(self, key: str) -> None:
        """This process deleted `key` (or gave up a decision not created): out of this copy now."""
        self._versions.pop(key, None)
        self._own_pending.discard(key)
        previous = self.items.pop(key, None)
        if previous is not None:
            self._notify(key, None, previous)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Follower(Generic[T, S]):
    """A cache fed by another's stream (`WatchCache.following`), and how a source item becomes its."""

    cache: WatchCache[S]
    convert: Callable[[T], S | None]

    def take(self, key: str, item: T, at: int) -> None:
        converted = self.convert(item)
        if converted is None:  # left out of this copy, as a label selector's watch says DELETED
            self.cache._take_deletion(key)
        else:
            self.cache._take(key, converted, at)


def _never_decoded(obj: Obj) -> Any:
    raise AssertionError("a following cache decodes nothing: its source's stream does")


class _GoneError(Exception):
    """The watch's resourceVersion is older than the API server's history: list again."""
