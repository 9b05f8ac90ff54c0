"""Webhook replicas share out GPUs that tie, so they do not all commit on the same one (issue #31).

Two replicas deciding at once from the same view pick the same "best" GPU; both create their booking
and race to move that GPU's ledger token, and the loser pays a rebase or a fresh decision (a GET, a
wait for the winner's booking, a second write). With two A100s tied under the spread policy, the
replicas' hashed preferences (`allocation._rank`) agreed half the time, and at concurrency 16 over half
the commits were rebased.

Here the replicas that are up (`ReplicaRoster`, fed from their Leases) deal the tied GPUs out like cards:
sorted by UUID, the i-th tied GPU goes to the (i mod n)-th replica in name order. With at least as
many tied GPUs as replicas each replica gets its own; with fewer, each replica still gets exactly one,
so only replicas sharing a GPU can meet. This is a preference only, never a lock: the token still
decides every race, so replicas that disagree on who is up, or on which GPUs tie, only conflict as
they did before, and a replica that goes away hands its GPUs over by being left out of the deal.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field


def dealt_to(me: str, *, tied: Iterable[str], replicas: Sequence[str]) -> frozenset[str]:
    """The tied GPUs (UUIDs) dealt to replica `me` among `replicas` (itself included); all of them
    when `me` is not among the replicas (it does not know it is up yet) or is the only one."""
    gpus = sorted(set(tied))
    names = sorted(set(replicas))
    if me not in names or len(names) < 2 or not gpus:
        return frozenset(gpus)
    seat = names.index(me)
    if len(gpus) < len(names):
        return frozenset({gpus[seat % len(gpus)]})
    return frozenset(g for i, g in enumerate(gpus) if i % len(names) == seat)


@dataclass(kw_only=True)
class ReplicaRoster:
    """Which webhook replicas are up, judged the way client-go's leader election judges a Lease: by
    when this process last saw each replica's Lease renewed, on its own monotonic clock (`now` is
    handed in), never by the times written in the Leases, which come from other machines' clocks."""

    lease_s: float
    """A replica whose Lease has not been seen renewed for this long is taken to be gone."""
    _seen: dict[str, tuple[str, float]] = field(default_factory=dict)
    """identity -> (the renewal last seen, when it was first seen)."""

    def observe(self, renewals: Mapping[str, str], *, now: float) -> None:
        """The Leases as they are now: replica identity -> its last renewal (any marker that changes
        with each renewal). Replicas whose Lease is gone are forgotten."""
        self._seen = {
            who: (mark, seen[1] if (seen := self._seen.get(who)) is not None and seen[0] == mark else now)
            for who, mark in renewals.items()
        }

    def up(self, *, now: float) -> tuple[str, ...]:
        """The replicas seen renewing within `lease_s`, in name order."""
        return tuple(sorted(who for who, (_, since) in self._seen.items() if now - since < self.lease_s))

    def long_gone(self, *, now: float, after_s: float) -> tuple[str, ...]:
        """Replicas not seen renewing for `after_s` (a crashed replica leaves its Lease behind)."""
        return tuple(sorted(who for who, (_, since) in self._seen.items() if now - since >= after_s))
