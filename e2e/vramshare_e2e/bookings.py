"""The phase of a cluster's bookings as `vramshare status` shows them: as written, but Bound where the
booking's pod exists (the controller writes nothing when a pod appears or starts: issue #45). Tests and
the demo read it through kubectl, as a person would."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from vramshare.kube.objects import GpuReservation
from vramshare.kube.resources import LABEL_RESERVATION
from vramshare.kube.sightings import PodsByLabel
from vramshare.status import shown_phase

GONE = "gone"


def shown_phases(kubectl: Callable[..., str], namespace: str) -> dict[str, str]:
    """Every GpuReservation of `namespace` by name, with the phase `vramshare status` shows."""
    bookings = json.loads(kubectl("get", "gpureservations", "-n", namespace, "-o", "json"))["items"]
    pods = json.loads(kubectl("get", "pods", "-n", namespace, "-l", LABEL_RESERVATION, "-o", "json"))["items"]
    return {name: phase for (_, name), phase in phases_of(bookings, pods).items()}


def phases_of(bookings: list[dict[str, Any]], pods: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    """Each booking by (namespace, name), with the phase `vramshare status` shows, from the objects."""
    by_label = PodsByLabel.of_pods(pods)
    return {
        (res.namespace, res.name): shown_phase(res, by_label.of(res.namespace, res.pod_label)).value
        for res in (GpuReservation.from_wire(b) for b in bookings)
    }


def shown_phase_of(kubectl: Callable[..., str], namespace: str, name: str) -> str:
    """The phase `vramshare status` shows for one booking; "gone" once it was deleted."""
    return shown_phases(kubectl, namespace).get(name, GONE)
