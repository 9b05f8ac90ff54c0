"""The reservation ledger in the API server, with an atomic commit that holds across webhook replicas.

Commit protocol (optimistic concurrency, no lock held anywhere):

1. List GpuDevices, noting each one's resourceVersion (the GPU's *ledger token*).
2. List GpuReservations at least as new as that list. Every reservation committed before a token
   was written is in it, because a commit creates its reservation before it bumps the token.
3. Decide with the pure domain.
4. Create the GpuReservation, then bump the chosen GPU's token with a merge patch that carries the
   resourceVersion from step 1 as a precondition.
5. If the token moved (409 Conflict: another replica committed on that GPU, or new metrics arrived),
   delete our reservation and start again from step 1. Otherwise label it committed, so observers
   of the ledger can tell it from a candidate that may still be withdrawn.

Any commit on a GPU between our steps 1 and 4 moves its token, so two admissions can never both
succeed on a view that misses the other. A reservation left behind by a crash between steps 4 and 5
has no pod and expires after the TTL; it can only make the GPU look fuller, never overbooked.

The webhook bounds its whole answer by a deadline below the API server's timeout. A commit cancelled
by that deadline anywhere after its create withdraws the reservation (bounded by a few seconds), so
an admission the API server gave up on leaves no booking behind; one that cannot be withdrawn (the
API server is what made us late) expires with the controller's short TTL, as Expired/PodNeverCreated.

A snapshot is reused for up to `max_age_s`, with this process's own commits applied to it (the new
reservation, and the token the bump returned). That is safe for the same reason: a GPU whose token
still matches has seen no commit and no new sample since; any other change turns into a conflict,
which drops the cached snapshot. Reuse only delays seeing memory that was released meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from vramshare.domain import Gpu, Reservation
from vramshare.kube.client import ApiError, KubeClient
from vramshare.kube.objects import GpuDevice, GpuReservation
from vramshare.kube.resources import (
    ANNOTATION_LEDGER,
    ANNOTATION_REINVOKED,
    LABEL_ACTIVE,
    LABEL_COMMITTED,
    LABEL_RESERVATION,
    device_name,
    devices_path,
    reservations_path,
)

log = structlog.get_logger("vramshare.ledger")

WITHDRAW_TIMEOUT_S = 3.0


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """GPUs and reservations as one admission sees them, with the tokens needed to commit."""

    gpus: tuple[Gpu, ...]
    reservations: tuple[Reservation, ...]
    tokens: dict[str, str]
    """GPU UUID -> resourceVersion of its GpuDevice when listed."""


class CommitConflictError(Exception):
    """The GPU's ledger token moved since the snapshot: decide again on a fresh one."""


class KubeLedger:
    def __init__(
        self, kube: KubeClient, *, max_age_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.kube = kube
        self.max_age_s = max_age_s
        self.clock = clock
        self._cached: Snapshot | None = None
        self._cached_at = 0.0

    async def snapshot(self, *, fresh: bool = False) -> Snapshot:
        """The cached view while it is young enough; with `fresh`, a consistent read (slower), as a
        refusal deserves: it must not come from a view that missed released memory or new GPUs."""
        if not fresh and self._cached is not None and self.clock() - self._cached_at < self.max_age_s:
            return self._cached
        self._cached = await self._read(consistent=fresh)
        self._cached_at = self.clock()
        return self._cached

    async def _read(self, *, consistent: bool) -> Snapshot:
        # Both reads come from the API server's cache, without its wait for a fresh etcd revision
        # (tens of ms per LIST). The devices may be slightly stale: a stale token only turns into a
        # conflict at commit. The reservations are read at least as new as the devices' list, so every
        # reservation committed before any token we hold is in them.
        devices = await self.kube.list(devices_path(), resource_version=None if consistent else "0")
        # Only the live ledger: ended reservations are labelled inactive by the controller. A reservation
        # without the label (made by hand) is counted, to be safe.
        listed = await self.kube.list(
            reservations_path(),
            label_selector=f"{LABEL_ACTIVE}!=false",
            resource_version=devices["metadata"]["resourceVersion"],
            not_older_than=True,
        )
        gpus, tokens = [], {}
        for obj in devices.get("items", []):
            device = GpuDevice.from_wire(obj)
            gpu = device.to_domain()
            if gpu is not None:
                gpus.append(gpu)
                tokens[gpu.uuid] = device.ledger_token
        reservations = tuple(GpuReservation.from_wire(o).to_domain() for o in listed.get("items", []))
        return Snapshot(gpus=tuple(gpus), reservations=reservations, tokens=tokens)

    async def get_reservation(self, namespace: str, name: str) -> GpuReservation | None:
        try:
            return GpuReservation.from_wire(await self.kube.get(reservations_path(namespace, name)))
        except ApiError as exc:
            if exc.not_found:
                return None
            raise

    async def claim_reinvocation(self, reservation: GpuReservation, *, claimant: str) -> bool:
        """Mark `reservation` as taken up by a reinvocation of its admission; False when another pass
        already did (the API server reinvokes a webhook at most once, so a second claim is a copy) or
        the reservation changed meanwhile."""
        if ANNOTATION_REINVOKED in reservation.meta.annotations:
            return False
        try:
            await self.kube.merge_patch(
                reservations_path(reservation.namespace, reservation.name),
                {
                    "metadata": {
                        "resourceVersion": reservation.meta.resource_version,
                        "annotations": {ANNOTATION_REINVOKED: claimant},
                    }
                },
            )
        except ApiError as exc:
            if exc.conflict or exc.not_found:
                return False
            raise
        return True

    async def pod_carries(self, namespace: str, reservation: str) -> bool:
        """Whether any pod already carries the reservation's label (a consistent read)."""
        pods = await self.kube.list(
            f"/api/v1/namespaces/{namespace}/pods", label_selector=f"{LABEL_RESERVATION}={reservation}"
        )
        return bool(pods.get("items"))

    async def commit(self, *, reservation: GpuReservation, token: str) -> GpuReservation:
        """Create `reservation` and bump its GPU's token; `CommitConflictError` when it moved."""
        gpu_uuid = reservation.spec.gpu_uuid
        created = GpuReservation.from_wire(
            await self.kube.create(reservations_path(reservation.namespace), reservation.to_wire())
        )
        try:
            bumped = await self.kube.merge_patch(
                devices_path(device_name(gpu_uuid)),
                {"metadata": {"resourceVersion": token, "annotations": {ANNOTATION_LEDGER: created.key}}},
            )
            try:
                await self.kube.merge_patch(
                    reservations_path(created.namespace, created.name),
                    {"metadata": {"labels": {LABEL_COMMITTED: "true"}}},
                )
            except ApiError as exc:  # the booking stands either way; only its label lags
                log.warning("reservation committed but not labelled", reservation=created.key, error=str(exc))
        except ApiError as exc:
            self._cached = None
            await self._withdraw(created)
            if exc.conflict or exc.not_found:
                raise CommitConflictError(f"GPU {gpu_uuid} changed while deciding") from exc
            raise
        except BaseException:
            # Cancelled (the answer's deadline passed) or failed anywhere before the admission is
            # answered: nobody will be told of this booking, so it must not stand.
            self._cached = None
            await self._withdraw(created)
            raise
        if self._cached is not None:  # our own commit, applied to the snapshot we keep
            cached = self._cached
            self._cached = Snapshot(
                gpus=cached.gpus,
                reservations=(*cached.reservations, created.to_domain()),
                tokens={**cached.tokens, gpu_uuid: bumped["metadata"]["resourceVersion"]},
            )
        return created

    async def _withdraw(self, created: GpuReservation) -> None:
        """Delete a booking nobody will use, within a few seconds; one that cannot be deleted (the API
        server is what made us late) expires with the reservation TTL instead."""
        try:
            await asyncio.wait_for(
                self.kube.delete(reservations_path(created.namespace, created.name)), WITHDRAW_TIMEOUT_S
            )
        except ApiError as exc:
            if not exc.not_found:
                log.warning("booking not withdrawn; it expires", reservation=created.key, error=str(exc))
        except (TimeoutError, OSError) as exc:
            log.warning("booking not withdrawn; it expires", reservation=created.key, error=repr(exc))
