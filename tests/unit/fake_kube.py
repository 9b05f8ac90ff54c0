"""An in-memory stand-in for `KubeClient`, for unit tests of the adapters' own logic.

It keeps objects by path with a global resourceVersion counter, honours resourceVersion
preconditions on merge patches, replaces and deletes (409 on a stale one), answers 404 and 409 as the
API server does, and lets a test break any call (`fail`). It is no model of the API server: the
integration tests run against a real one.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime as dt
from collections.abc import AsyncIterator, Callable
from typing import Any

from vramshare.domain import Gpu
from vramshare.kube.client import ApiError
from vramshare.kube.objects import DeviceSpec, DeviceStatus, GpuDevice
from vramshare.kube.resources import devices_path

Obj = dict[str, Any]

NOW_STAMP = "2027-01-15T08:00:00Z"


def _merge(target: Obj, patch: Obj) -> Obj:
    """RFC 7386 JSON merge patch."""
    out = copy.deepcopy(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _named(obj: Obj, field_selector: str | None) -> bool:
    """The one field selector vramshare uses: `metadata.name=<name>`."""
    if not field_selector:
        return True
    field, _, value = field_selector.partition("=")
    assert field == "metadata.name", field_selector
    return bool(obj["metadata"]["name"] == value)


def _selected(obj: Obj, selector: str | None) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    for term in (selector or "").split(","):
        term = term.strip()
        if not term:
            continue
        if "!=" in term:
            key, value = term.split("!=")
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.split("=")
            if labels.get(key) != value:
                return False
        elif term not in labels:
            return False
    return True


class FakeKube:
    def __init__(self, *, clock: Callable[[], float] | None = None) -> None:
        self.objects: dict[str, Obj] = {}
        self.version = 0
        self.pages = 0
        """LIST answers given (a paged LIST is several)."""
        self.calls: list[tuple[str, str]] = []
        self.fail: Callable[[str, str], BaseException | None] = lambda op, path: None
        """Called before every operation with (operation, path); a returned exception is raised."""
        self.clock = clock
        self.events: list[tuple[int, str, str, Obj]] = []
        """(resourceVersion, path, type, object) of every change, for watches."""
        self._changed = asyncio.Event()

    def _record(self, path: str, kind: str, obj: Obj) -> None:
        self.events.append((int(obj["metadata"]["resourceVersion"]), path, kind, copy.deepcopy(obj)))
        self._changed.set()
        self._changed = asyncio.Event()

    async def watch(
        self,
        path: str,
        *,
        resource_version: str,
        label_selector: str | None = None,
        field_selector: str | None = None,
        timeout_s: int = 300,
    ) -> AsyncIterator[Obj]:
        """Every change after `resource_version` under `path`, then new ones as they come."""
        self._check("watch", path)
        since = int(resource_version)
        prefix = path.rstrip("/") + "/"
        # As the API server does: an object that stops matching the selector is DELETED for this watch.
        matching = {
            p for p, o in self.objects.items() if _selected(o, label_selector) and _named(o, field_selector)
        }
        while True:
            for rv, at, kind, obj in list(self.events):
                if rv <= since:
                    continue
                since = rv
                if not (at.startswith(prefix) or _in_all_namespaces(at, path)):
                    continue
                if kind != "DELETED" and _selected(obj, label_selector) and _named(obj, field_selector):
                    matching.add(at)
                    yield {"type": kind, "object": copy.deepcopy(obj)}
                elif at in matching:
                    matching.discard(at)
                    yield {"type": "DELETED", "object": copy.deepcopy(obj)}
            await self._changed.wait()

    def _check(self, op: str, path: str) -> None:
        self.calls.append((op, path))
        error = self.fail(op, path)
        if error is not None:
            raise error

    def _bump(self, obj: Obj) -> Obj:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        return obj

    def _found(self, path: str) -> Obj:
        if path not in self.objects:
            raise ApiError(status=404, reason="NotFound", message=f"{path} not found")
        return self.objects[path]

    def _precondition(self, current: Obj, version: str | None) -> None:
        if version is not None and version != current["metadata"]["resourceVersion"]:
            raise ApiError(status=409, reason="Conflict", message="the object has been modified")

    async def get(self, path: str, *, resource_version: str | None = None) -> Obj:
        self._check("get", path)
        return copy.deepcopy(self._found(path))

    async def list(
        self,
        path: str,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        resource_version: str | None = None,
        not_older_than: bool = False,
        limit: int | None = None,
        continue_token: str | None = None,
    ) -> Obj:
        self._check("list", path)
        await asyncio.sleep(0)  # a real LIST takes a while: let other requests arrive meanwhile
        prefix = path.rstrip("/") + "/"
        items = [
            copy.deepcopy(o)
            for p, o in sorted(self.objects.items())
            if (p.startswith(prefix) or _in_all_namespaces(p, path))
            and _selected(o, label_selector)
            and _named(o, field_selector)
        ]
        start = int(continue_token or 0)
        end = start + limit if limit else len(items)
        meta: Obj = {"resourceVersion": str(self.version)}
        if end < len(items):
            meta["continue"] = str(end)
        self.pages += 1
        return {"metadata": meta, "items": items[start:end]}

    async def create(self, path: str, obj: Obj, *, dry_run: bool = False) -> Obj:
        self._check("create", path)
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if "name" not in meta:
            meta["name"] = f"{meta.get('generateName', 'obj-')}{self.version + 1}"
        at = f"{path}/{meta['name']}"
        if at in self.objects:
            raise ApiError(status=409, reason="AlreadyExists", message=f"{meta['name']} already exists")
        meta.setdefault("uid", f"uid-{self.version + 1}")
        meta["generation"] = 1
        stamp = NOW_STAMP
        if self.clock is not None:
            stamp = dt.datetime.fromtimestamp(self.clock(), dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        meta.setdefault("creationTimestamp", stamp)
        if not dry_run:
            self.objects[at] = self._bump(obj)
            self._record(at, "ADDED", obj)
        return copy.deepcopy(obj)

    async def replace(self, path: str, obj: Obj) -> Obj:
        self._check("replace", path)
        current = self._found(path)
        self._precondition(current, obj.get("metadata", {}).get("resourceVersion"))
        self.objects[path] = self._bump(copy.deepcopy(obj))
        self._record(path, "MODIFIED", self.objects[path])
        return copy.deepcopy(self.objects[path])

    async def merge_patch(self, path: str, patch: Obj) -> Obj:
        self._check("merge_patch", path)
        target = path.removesuffix("/status")
        current = self._found(target)
        self._precondition(current, (patch.get("metadata") or {}).get("resourceVersion"))
        if path.endswith("/status"):  # the status subresource takes only status
            patch = {"status": patch.get("status", {})}
        else:
            patch = {k: v for k, v in patch.items() if k != "status"}
        merged = _merge(current, patch)
        if merged.get("spec") != current.get("spec"):  # as the API server does: spec changes only
            merged["metadata"]["generation"] = int(current["metadata"].get("generation") or 1) + 1
        return self._store(target, merged)

    def _store(self, path: str, obj: Obj) -> Obj:
        """Write a changed object; as the API server does, one being deleted whose last finalizer is
        gone goes away."""
        if obj["metadata"].get("deletionTimestamp") and not obj["metadata"].get("finalizers"):
            self._remove(path, obj)
            return copy.deepcopy(obj)
        self.objects[path] = self._bump(obj)
        self._record(path, "MODIFIED", self.objects[path])
        return copy.deepcopy(self.objects[path])

    async def json_patch(self, path: str, operations: list[Obj]) -> Obj:
        """The ops vramshare sends: test and remove on metadata.finalizers, add and replace anywhere."""
        self._check("json_patch", path)
        current = copy.deepcopy(self._found(path))
        for op in operations:
            *parents, last = op["path"].lstrip("/").split("/")
            holder: Any = current
            for part in parents:
                holder = holder[int(part)] if isinstance(holder, list) else holder.setdefault(part, {})
            key: Any = int(last) if isinstance(holder, list) else last
            if op["op"] == "test":
                try:
                    found = holder[key]
                except (IndexError, KeyError):
                    found = None
                if found != op["value"]:
                    raise ApiError(status=422, reason="Invalid", message=f"test failed at {op['path']}")
            elif op["op"] == "remove":
                del holder[key]
            else:
                holder[key] = op["value"]
        return self._store(path, current)

    async def delete(self, path: str, *, resource_version: str | None = None) -> Obj:
        self._check("delete", path)
        current = self._found(path)
        self._precondition(current, resource_version)
        if current["metadata"].get("finalizers"):  # kept, marked, until its finalizers are removed
            if not current["metadata"].get("deletionTimestamp"):
                current["metadata"]["deletionTimestamp"] = NOW_STAMP
                self.objects[path] = self._bump(current)
                self._record(path, "MODIFIED", current)
            return copy.deepcopy(current)
        self._remove(path, current)
        return {"status": "Success"}

    def _remove(self, path: str, current: Obj) -> None:
        self.objects.pop(path, None)
        self.version += 1
        gone = copy.deepcopy(current)
        gone["metadata"]["resourceVersion"] = str(self.version)
        self._record(path, "DELETED", gone)


def _in_all_namespaces(path: str, collection: str) -> bool:
    """A cluster-wide list (/apis/g/v/kind) also returns namespaced objects of that kind."""
    group, _, kind = collection.rpartition("/")
    return path.startswith(f"{group}/namespaces/") and f"/{kind}/" in path


@contextlib.asynccontextmanager
async def fed_state(kube: FakeKube) -> AsyncIterator[Any]:
    """The controller's ClusterState, synced from `kube` and following it until the block ends."""
    from vramshare.controller.state import ClusterState

    state = ClusterState(kube)  # type: ignore[arg-type]
    feeding = asyncio.create_task(state.run())
    try:
        await asyncio.wait_for(state.wait_synced(), 2)
        yield state
    finally:
        feeding.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await feeding


async def add_idle_gpu(kube: FakeKube, gpu: Gpu) -> None:
    """A GpuDevice for `gpu`, Ready, nothing used or booked, sampled at the GPU's own sample time."""
    device = GpuDevice.new(DeviceSpec(uuid=gpu.uuid, node_name=gpu.node, index=gpu.index, model=gpu.model))
    status = DeviceStatus(
        total_mib=gpu.total_mib,
        used_mib=0,
        free_mib=gpu.total_mib,
        driver_reserved_mib=0,
        reserved_mib=0,
        headroom_mib=gpu.total_mib,
        sampled_at=gpu.sampled_at,
        last_seen_at=gpu.sampled_at,
        state="Ready",
    )
    await kube.create(devices_path(), {**device.to_wire(), "status": status.to_wire()})
