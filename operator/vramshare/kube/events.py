"""Posting Kubernetes Events: what `kubectl describe` shows a person about a pod or a GPU."""

from __future__ import annotations

from dataclasses import dataclass

from vramshare.kube.client import KubeClient
from vramshare.kube.resources import events_path, format_time


@dataclass(frozen=True, kw_only=True)
class Involved:
    """The object an event is about."""

    api_version: str
    kind: str
    name: str
    uid: str
    namespace: str | None = None


@dataclass(frozen=True, kw_only=True)
class Event:
    type: str  # Normal or Warning
    reason: str
    message: str


async def post_event(
    kube: KubeClient, *, namespace: str, involved: Involved, event: Event, now: float, reporter: str
) -> None:
    stamp = format_time(now)
    about = {
        "apiVersion": involved.api_version,
        "kind": involved.kind,
        "name": involved.name,
        "uid": involved.uid,
    }
    if involved.namespace is not None:
        about["namespace"] = involved.namespace
    await kube.create(
        events_path(namespace),
        {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{involved.name}.", "namespace": namespace},
            "involvedObject": about,
            "type": event.type,
            "reason": event.reason,
            "message": event.message,
            "source": {"component": "vramshare-controller"},
            "reportingComponent": "vramshare.io/controller",
            "reportingInstance": reporter,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        },
    )
