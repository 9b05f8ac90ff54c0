"""Grants: room on one GPU that one webhook replica books its pods in with a create alone (issue #45).

A booking's commit is a create and a bump of its GPU's ledger token (`vramshare.kube.ledger.commit`).
The bump is what makes every other replica's decision on an older view fail, and it is the dearest
part of a booking: it is one more write in a row on the answer's path, and every watcher of the GPUs
decodes it. A grant pays that bump once for many pods:

- A replica that commits a pod on a GPU takes a grant there in the same commit (one more create; the
  one bump names both): a GpuReservation in phase Granted, sized by `grant_size`.
- Every reader counts a grant's **remainder**, what its bookings do not use yet, as booked and not yet
  started: `max(0, grant - bookings inside it)`. The bookings inside are counted as any booking.
- The replica that holds the grant books a later pod inside it, when the remainder takes the whole
  pod, with a create alone. Such a booking changes no GPU total any reader computes: what it adds, the
  remainder loses. A reader that has not seen it yet counts the same memory as the remainder, so no
  other decision can be wrong for want of it, and no token needs to move.
- Only the replica that took a grant books inside it, and only while its grant is **usable**: the
  controller has recorded it Granted (so it knows grants: an older one would end it as a booking whose
  pod never came, after the reservation TTL), and it is renewed every third of `lasts_s`, and usable
  until `lasts_s - margin_s` after the last renewal that succeeded was sent, by the replica's own clock.
  The controller ends a grant (Expired, GrantLapsed) once it has not seen the grant change for `lasts_s
  + margin_s` by its own clock (`lapsed`): a replica that died or lost the API server stops booking in
  its grants before anyone can take their room back (client-go's lease rule; no two clocks are
  compared). A booking whose create came back after its grant stopped being usable is withdrawn and
  decided again: the API server may have stored it after the grant ended.
- A grant nothing was booked in for `idle_s` is given back (deleted), and so is every grant at shutdown.
  Its end needs no bump either: a reader that sees it end has seen every booking made inside it, as a
  watch delivers one resource's changes in order, and each of those bookings now counts on its own.

A grant costs packing while it is held: other replicas count its remainder as used. `grant_size`
takes at most a quarter of the room left, so a grant never takes a GPU's last room, and a holder
gives a grant back as soon as it holds more than its GPU has left for everyone else (`relieves`): as
a GPU fills, the room in grants returns to all.

Pure: the arithmetic and the rules, no clock and no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from vramshare.domain.models import Reservation, ReservationPhase

MARGIN_S = 2.0
"""How much earlier than the controller a holder stops trusting its grant (clock rates, and the time a
create may take between its send and the API server storing it); the controller waits as much longer."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GrantTerms:
    """How grants are taken and kept: the webhook's settings, and what the controller reads from each
    grant (`lasts_s`)."""

    pods: int = 0
    """A grant takes room for this many pods the size of the one it is taken with; 0: no grants."""
    lasts_s: float = 15.0
    """A grant not renewed for this long (plus `margin_s`) has lapsed."""
    margin_s: float = MARGIN_S
    idle_s: float = 10.0
    """A grant with no booking inside for this long is given back."""

    @property
    def enabled(self) -> bool:
        return self.pods > 0

    @property
    def renew_every_s(self) -> float:
        return self.lasts_s / 3

    @property
    def usable_for_s(self) -> float:
        """How long after a renewal was sent the holder may book inside the grant."""
        return max(0.0, self.lasts_s - self.margin_s)

    @property
    def lapses_after_s(self) -> float:
        """How long the controller waits, unrenewed, before it ends a grant."""
        return self.lasts_s + self.margin_s


MIN_LASTS_S = 3.0
MAX_LASTS_S = 3600.0


def grant_size(*, terms: GrantTerms, pod_mib: int, room_left_mib: int) -> int:
    """MiB of the grant to take with a pod of `pod_mib`, where `room_left_mib` is the GPU's headroom
    once that pod is booked; 0 when none is worth taking (it would not hold one more such pod)."""
    if not terms.enabled or pod_mib <= 0:
        return 0
    size = min(terms.pods * pod_mib, room_left_mib // 4)
    return size if size >= pod_mib else 0


def remainder(*, grant_mib: int, inside_mib: int) -> int:
    """What a grant still holds for its holder's next pods."""
    return max(0, grant_mib - inside_mib)


def takes(*, grant_mib: int, inside_mib: int, pod_mib: int) -> bool:
    """Whether a pod fits inside the grant whole (a pod is never split between a grant and the rest)."""
    return 0 < pod_mib <= remainder(grant_mib=grant_mib, inside_mib=inside_mib)


def lapsed(*, unrenewed_s: float, lasts_s: float, margin_s: float) -> bool:
    """Whether a grant seen unchanged for `unrenewed_s` (by the reader's own clock) has lapsed."""
    return unrenewed_s >= lasts_s + margin_s


def granted_by_gpu(reservations: Iterable[Reservation]) -> dict[str, int]:
    """GPU UUID -> the remainders of the active grants on it: room held for some replica's next pods,
    which every other decision counts as booked (for messages: it comes back when they are given
    back)."""
    granted: dict[tuple[str, str], int] = {}
    inside: dict[tuple[str, str], int] = {}
    for r in reservations:
        if not r.is_active:
            continue
        if r.phase is ReservationPhase.GRANTED:
            granted[(r.key, r.gpu_uuid)] = granted.get((r.key, r.gpu_uuid), 0) + r.mib
        elif r.grant:
            inside[(r.grant, r.gpu_uuid)] = inside.get((r.grant, r.gpu_uuid), 0) + r.mib
    out: dict[str, int] = {}
    for (key, gpu_uuid), mib in granted.items():
        left = remainder(grant_mib=mib, inside_mib=inside.get((key, gpu_uuid), 0))
        if left:
            out[gpu_uuid] = out.get(gpu_uuid, 0) + left
    return out


def relieves(*, remainder_mib: int, room_for_others_mib: int) -> bool:
    """Whether a grant holding `remainder_mib` should be given back, its GPU having
    `room_for_others_mib` left for everyone else."""
    return remainder_mib > 0 and room_for_others_mib < remainder_mib
