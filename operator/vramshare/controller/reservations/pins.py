"""Which pod each booking is bound to, kept in the controller's memory.

**A booking whose pod exists is bound in memory, not in writing** (issue #45). The status write that
recorded it (phase Bound, the pod's UID and start) was one API write per admitted pod, and every reader
can see the same from the pod: the webhooks count a booking from its pod's start through their own pod
watch (`vramshare.domain.with_its_pod`), and the reconciler pins the pod's UID here the first time it
sees the pod and plans from the booking as bound (`Pins.as_bound`). The booking's written phase stays
Reserved (the CRD's default) until something is written anyway: its end (Released, with the pod's UID
and start), or its GPU going missing (Lost). After a restart or a failover the pins are rebuilt from
the pods as the sweep finds them: the earliest pod that `belongs` to each booking, as before a bind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

from vramshare.domain import PodSighting, PodState, ReservationPhase
from vramshare.kube.objects import GpuReservation


class Pins:
    def __init__(self, *, on_bound: Callable[[GpuReservation], None]) -> None:
        self._uids: dict[str, str] = {}
        """Reservation key -> the UID of its pod, pinned when first seen."""
        self._on_bound = on_bound
        """Told once of each booking bound here (a metric, its TTL timer cancelled)."""

    def of(self, key: str) -> str | None:
        """The UID pinned for the booking `key` (namespace/name), if any."""
        return self._uids.get(key)

    def uid_of(self, res: GpuReservation) -> str | None:
        """The UID of the pod `res` belongs to, as written (a queue entry's, or a booking's once it
        ended or was lost) or pinned here; None while none was seen."""
        return res.status.pod_uid or self._uids.get(res.key)

    def keep_only(self, keys: Iterable[str]) -> None:
        """Forget the pins of bookings that no longer exist."""
        kept = set(keys)
        for key in self._uids.keys() - kept:
            del self._uids[key]

    def as_bound(self, res: GpuReservation, pod: PodSighting | None) -> GpuReservation:
        """`res` as the plan is to see it: a Reserved booking whose pod exists (or was pinned here) is
        Bound to that pod from its start, without a write."""
        if res.phase is not ReservationPhase.RESERVED or res.queue_entry:
            # A queue entry's placement is written anyway (its status still says Queued): Bound is
            # that write, as before.
            return res
        if pod is not None and pod.state is PodState.ACTIVE and self._uids.get(res.key) != pod.uid:
            first = res.key not in self._uids
            self._uids[res.key] = pod.uid
            if first:
                self._on_bound(res)
        uid = self.uid_of(res)
        if uid is None or (pod is not None and pod.uid != uid):
            return res
        started = res.status.pod_running_since
        if started is None and pod is not None:
            started = pod.running_since
        bound = replace(
            res.status,
            phase=ReservationPhase.BOUND,
            reason="PodBound",
            message="its pod exists",
            pod_uid=uid,
            pod_running_since=started,
        )
        return replace(res, status=bound)
