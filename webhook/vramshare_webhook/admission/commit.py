"""Step 5d, commit: a pod's bookings written to the ledger, each on its GPU's token, all or nothing
(see the commit protocol in `vramshare.kube.ledger.commit`)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from vramshare.domain import Gpu
from vramshare.domain.snapshot import CommitConflictError, Snapshot
from vramshare.kube.objects import GpuReservation
from vramshare_webhook.admission.context import Ledger
from vramshare_webhook.admission.intent import Intent


def bookings_for(intent: Intent, *, name: str, gpus: Sequence[Gpu]) -> list[GpuReservation]:
    """One booking per GPU of the pod: the first named as the pod's label says, the others after it."""
    request = intent.request
    return [
        GpuReservation.new(
            name=name if i == 0 else f"{name}-gpu{i}",
            namespace=request.namespace,
            pod=intent.facts.display_name,
            mib=intent.mib,
            gpu=g,
            admission_uid=request.uid,
            user=request.username,
            set_name=name if len(gpus) > 1 else "",
            gpu_count=len(gpus),
        )
        for i, g in enumerate(gpus)
    ]


async def commit_all(
    bookings: list[GpuReservation], snapshot: Snapshot, *, ledger: Ledger, room_left_mib: int | None = None
) -> str | None:
    """Commit every booking of one pod, each on its own GPU's token, all or nothing: when one loses
    its race the others are withdrawn and the UUID of the GPU that conflicted is returned. Until
    they are withdrawn they only make other decisions more careful, never less. `room_left_mib`: the
    GPU's headroom once a single booking is made, from which the ledger may take a grant with it."""
    if len(bookings) == 1:
        booking = bookings[0]
        try:
            await ledger.commit(
                reservation=booking,
                token=snapshot.tokens[booking.spec.gpu_uuid],
                live=snapshot.live,
                grant_room_mib=room_left_mib,
            )
        except CommitConflictError:
            return booking.spec.gpu_uuid
        return None
    # Every booking joins this process's view before the first await, as a single commit's does:
    # the commits below start only at the next turn of the loop, and a decision made meanwhile must
    # count them, or it could take the same GPUs on the strength of a chain it never saw.
    for b in bookings:
        ledger.decided(b)
    try:
        results = await asyncio.gather(
            *(
                ledger.commit(reservation=b, token=snapshot.tokens[b.spec.gpu_uuid], live=snapshot.live)
                for b in bookings
            ),
            return_exceptions=True,
        )
    except BaseException:  # cancelled (the deadline): commits that never started leave the view
        for b in bookings:
            ledger.undecided(b)
        raise
    made = [r for r in results if isinstance(r, GpuReservation)]
    if len(made) == len(bookings):
        return None
    await asyncio.gather(*(ledger.withdraw(r) for r in made))
    for booking, result in zip(bookings, results, strict=True):
        if isinstance(result, CommitConflictError):
            return booking.spec.gpu_uuid
    raise next(r for r in results if isinstance(r, BaseException))
