"""JSON Patch building blocks shared by the pod patches and the delivery modes: pure functions."""

from __future__ import annotations

from typing import Any

Obj = dict[str, Any]
Operation = dict[str, Any]

CONTAINER_LISTS = ("initContainers", "containers")
"""The containers a pod is created with (ephemeral debug containers come later, by their own request)."""


def pointer(*parts: str | int) -> str:
    """A JSON Pointer (RFC 6901): '~' is written '~0' and '/' is written '~1'."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def containers(pod: Obj, lists: tuple[str, ...] = CONTAINER_LISTS) -> list[tuple[str, int, Obj]]:
    """(list, index, container) for each container of `lists` in the pod."""
    spec = pod.get("spec", {})
    return [(key, i, c) for key in lists for i, c in enumerate(spec.get(key) or []) if isinstance(c, dict)]
