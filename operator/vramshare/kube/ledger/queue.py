"""Queue entries and holds in the ledger: an entry created (it books nothing), placed on a GPU through
the commit protocol, or taken back to the queue; a hold withdrawn once its task is in."""

from __future__ import annotations

import structlog

from vramshare.domain import Gpu
from vramshare.kube.client import ApiError
from vramshare.kube.ledger.commit import CommitProtocol
from vramshare.kube.objects import GpuReservation
from vramshare.kube.resources import (
    reservations_path,
)

log = structlog.get_logger("vramshare.ledger")


class QueueWrites(CommitProtocol):
    """Queue and hold writes (see the module docstring)."""

    async def enqueue(self, reservation: GpuReservation) -> GpuReservation:
        """Create a queue entry (no GPU: it books nothing, so no token moves)."""
        self.on_write("gpureservations", "create")
        return GpuReservation.from_wire(
            await self.kube.create(reservations_path(reservation.namespace), reservation.to_wire())
        )

    async def place(
        self, *, entry: GpuReservation, gpu: Gpu, token: str, live: bool = False
    ) -> GpuReservation:
        """Book `gpu` for a queue entry through the same commit as an admission: its placement is
        written (with the entry's resourceVersion as a precondition, so two controllers cannot both
        place it), then the GPU's token is bumped naming it; `CommitConflictError` when either moved.

        A placement that committed stands even if the caller gives up meanwhile (its leadership
        ended): its pod exists and waits behind its gate, and the label `committed` lets the next
        leader lift it (see `vramshare.controller.queue`)."""
        return await self.commit(reservation=entry.placed_on(gpu), token=token, live=live, places=True)

    async def unplace(self, entry: GpuReservation) -> bool:
        """Take a placed queue entry back to the queue, unless it changed since `entry` was read (a
        leader still committing it labels it, or placed it anew); False then."""
        return await self._withdraw(entry, unplace=True)

    async def withdraw_hold(self, namespace: str, name: str) -> None:
        """Delete a hold whose task was just admitted, off the answer's path: it runs after the task's
        commit succeeded, so a slow delete must not make the admission miss its deadline (it would
        answer Late while the booking stands). A hold that stays lapses on its own."""
        self._later(self._delete_hold(namespace, name))

    async def _delete_hold(self, namespace: str, name: str) -> None:
        self.on_write("gpureservations", "delete")
        try:
            await self.kube.delete(reservations_path(namespace, name))
        except ApiError as exc:
            if not exc.not_found:
                log.warning(
                    "hold not withdrawn; it lapses", reservation=f"{namespace}/{name}", error=str(exc)
                )
