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
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

import structlog

from vramshare.kube.client import ApiError, KubeClient, Obj

log = structlog.get_logger("vramshare.watch")

T = TypeVar("T")

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
        self.resource_version = 0
        """Every event up to this resourceVersion is applied (advanced by the stream only)."""
        self.synced = asyncio.Event()
        self.streaming = False
        """True while a watch stream is open: the cache follows the API server live."""
        self.relists = 0
        self._progress = asyncio.Condition()
        self._on_change: list[Callable[[str, T | None, T | None], None]] = []

    @property
    def newest_version(self) -> int:
        """The newest resourceVersion this cache holds: the stream's, or a write of this process's own
        that is ahead of it."""
        return max(self.resource_version, max(self._versions.values(), default=0))

    def on_change(self, callback: Callable[[str, T | None, T | None], None]) -> None:
        """Call `callback(key, item or None when deleted, the item before)` for every change."""
        self._on_change.append(callback)

    async def run(self) -> None:
        """List, then watch until cancelled; never returns otherwise."""
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
                self.streaming = False

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
        # What the list cannot know: this process's own decisions not created yet, and items newer
        # than the list (written, by this process, after the list's snapshot).
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
        self.resource_version = listed
        for key in set(before) - set(items):
            self._notify(key, None, before[key])
        for key, item in items.items():
            self._notify(key, item, before.get(key))
        self.synced.set()
        await self._advance()

    async def _watch(self) -> None:
        self.streaming = True
        async for event in self.kube.watch(
            self.path,
            resource_version=str(self.resource_version),
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
                key = key_of(obj)
                held = self._versions.get(key, 0)
                if version(obj) and version(obj) < held:
                    self.stale_events += 1  # older than this process's own write of it
                elif version(obj) and version(obj) == held and key in self.items:
                    # A resourceVersion names one state of the object: the one this process wrote and
                    # put already. The webhooks' own bookings and token bumps came back as events and
                    # were decoded and counted again (issue #45).
                    self.echoes += 1
                else:
                    item = self.decode(obj)
                    previous = self.items.get(key)
                    self.items[key] = item
                    self._versions[key] = version(obj)
                    self._own_pending.discard(key)
                    self._notify(key, item, previous)
            elif kind == "DELETED":
                key = key_of(obj)
                previous = self.items.pop(key, None)
                self._versions.pop(key, None)
                self._own_pending.discard(key)
                self._notify(key, None, previous)
            self.resource_version = max(self.resource_version, version(obj))
            await self._advance()

    def _notify(self, key: str, item: T | None, previous: T | None) -> None:
        for callback in self._on_change:
            callback(key, item, previous)

    async def _advance(self) -> None:
        async with self._progress:
            self._progress.notify_all()

    async def wait_for(self, resource_version: int, *, timeout_s: float) -> bool:
        """Wait until the stream has passed `resource_version`; False if it did not within the time."""
        if self.resource_version >= resource_version:
            return True
        try:
            async with asyncio.timeout(timeout_s), self._progress:
                await self._progress.wait_for(lambda: self.resource_version >= resource_version)
        except TimeoutError:
            return False
        return True

    def put(self, key: str, item: T, *, resource_version: int | str | None = None) -> None:
        """This process's own write, known before its event arrives: `resource_version` is the
        written object's (the events of older versions then never replace it); without one, a
        decision not created yet, kept across relists until its object's event or `drop`."""
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
        self._versions.pop(key, None)
        self._own_pending.discard(key)
        previous = self.items.pop(key, None)
        if previous is not None:
            self._notify(key, None, previous)


class _GoneError(Exception):
    """The watch's resourceVersion is older than the API server's history: list again."""
