"""Reads and writes that expect an object to move or go meanwhile: a GET that answers None for an object
that is gone, and an annotation written only onto the version of an object that was judged."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from vramshare.kube.client import ApiError, KubeClient, Obj
from vramshare.kube.objects import GpuReservation
from vramshare.kube.resources import reservations_path


async def get_or_none(kube: KubeClient, path: str, *, resource_version: str | None = None) -> Obj | None:
    """The object at `path`, or None when it does not exist (404)."""
    try:
        return await kube.get(path, resource_version=resource_version)
    except ApiError as exc:
        if exc.not_found:
            return None
        raise


async def read_reservation(kube: KubeClient, namespace: str, name: str) -> GpuReservation | None:
    """A GpuReservation as stored now (a quorum read), or None when it does not exist."""
    obj = await get_or_none(kube, reservations_path(namespace, name))
    return GpuReservation.from_wire(obj) if obj is not None else None


async def annotate_unchanged(
    kube: KubeClient,
    path: str,
    *,
    version: str,
    annotations: Mapping[str, str],
    still: Callable[[Obj], bool],
    attempts: int,
    on_write: Callable[[], None] = lambda: None,
) -> bool:
    """Annotate the object at `path` with the resourceVersion it was judged at (`version`) as a
    precondition, so the write lands only on that version. True once written; False when the object is
    gone, or when, read again after a conflict (another change landed meanwhile), `still` no longer holds
    for it; otherwise the write is retried on the new version, `attempts` writes in all."""
    for _ in range(attempts):
        try:
            on_write()
            await kube.merge_patch(
                path, {"metadata": {"resourceVersion": version, "annotations": dict(annotations)}}
            )
            return True
        except ApiError as exc:
            if exc.not_found:
                return False
            if not exc.conflict:
                raise
        current = await get_or_none(kube, path)
        if current is None or not still(current):
            return False
        version = str(current["metadata"]["resourceVersion"])
    return False


def annotations_of(obj: Obj) -> Mapping[str, str]:
    annotations = obj.get("metadata", {}).get("annotations")
    return annotations if isinstance(annotations, dict) else {}
