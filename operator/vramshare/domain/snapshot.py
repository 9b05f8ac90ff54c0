"""The ledger as one admission sees it: GPUs, bookings and the tokens to commit on (pure).

A `Snapshot` is handed out by the ledger adapter (`vramshare.kube.ledger`): either a live view, whose
bookings are summed per GPU in the watch cache's own `LedgerIndex`, or a consistent read, whose
bookings are listed. The questions an admission asks of it are answered here the same way for both.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramshare.domain.bookings import LedgerIndex
from vramshare.domain.grants import granted_by_gpu
from vramshare.domain.models import Gpu, Reservation
from vramshare.domain.tenancy import (
    Holding,
    Holdings,
    awaits_its_pod,
    holding_of,
    holdings_of,
    pending_of_user,
)


class CommitConflictError(Exception):
    """The GPU's ledger token moved since the snapshot: decide again on a fresh one."""


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """GPUs and reservations as one admission sees them, with the tokens needed to commit."""

    gpus: tuple[Gpu, ...]
    reservations: tuple[Reservation, ...]
    tokens: dict[str, str]
    """GPU UUID -> resourceVersion of its GpuDevice when read."""
    index: LedgerIndex | None = None
    """For a live view: the same ledger summed per GPU (then `reservations` is left empty). It is the
    cache's own index, current only until the next await: decide on it at once."""
    live: bool = False
    """Built from the watch caches at the moment it was handed out, with every decision this process
    had made by then. Only such a view may commit on a token our own later commits moved (see
    `KubeLedger.commit`); a consistent read is a picture of an earlier moment, possibly shared."""

    def pending_in(self, namespace: str) -> int:
        """Bookings in `namespace` whose pod has not appeared yet."""
        if self.index is not None:
            return self.index.pending_in(namespace)
        return sum(1 for r in self.reservations if r.namespace == namespace and awaits_its_pod(r))

    def holds_for(self, task_key: str) -> list[Reservation]:
        """The memory held for that task (by an earlier refusal of it)."""
        if self.index is not None:
            return self.index.holds_for(task_key)
        return [r for r in self.reservations if r.is_active and r.held_for == task_key]

    def holdings(self, namespace: str) -> Holdings:
        """What `namespace` holds (see `vramshare.domain.tenancy`)."""
        if self.index is not None:
            return self.index.holdings(namespace)
        return holdings_of(self.reservations, namespace)

    def pending_bookings(self) -> list[Reservation]:
        if self.index is not None:
            return self.index.pending_bookings()
        return [r for r in self.reservations if holding_of(r) is Holding.PENDING]

    def pending_of_user(self, user: str) -> int:
        if self.index is not None:
            return self.index.pending_of_user(user)
        return pending_of_user(self.reservations, user)

    def granted_by_gpu(self) -> dict[str, int]:
        """GPU UUID -> room its grants hold for some replica's next pods (`vramshare.domain.grants`)."""
        return granted_by_gpu(self.index.reservations() if self.index is not None else self.reservations)

    def held_gpus(self) -> set[str]:
        """GPUs that keep memory for a refused task's next try."""
        if self.index is not None:
            return self.index.held_gpus()
        return {r.gpu_uuid for r in self.reservations if r.is_active and r.held_for}
