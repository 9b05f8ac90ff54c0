"""Writes off the answer's path: withdrawing a booking nobody will use, and labelling a placement or
hold committed (see `vramshare.kube.ledger.commit`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from vramshare.kube.client import ApiError, KubeClient
from vramshare.kube.objects import GpuReservation, remove_finalizer
from vramshare.kube.resources import FINALIZER_POD_GONE, LABEL_COMMITTED, LABEL_GPU, reservations_path

log = structlog.get_logger("vramshare.ledger")

WITHDRAW_TIMEOUT_S = 3.0

LABEL_ATTEMPTS = 5

LABEL_BACKOFF_S = 0.2
"""The committed label is retried this many times, waiting 0.2, 0.4, 0.8, 1.6 s in between."""


async def label_committed(
    kube: KubeClient, created: GpuReservation, *, on_write: Callable[[str, str], None]
) -> None:
    """Label a placement or hold committed, off the answer's path, retried while the API server
    fails: a placement left unlabelled goes back to the queue (nobody vouches for it), and
    observers count only labelled ones. The booking stands either way."""
    error = ""
    for attempt in range(LABEL_ATTEMPTS):
        if attempt:
            await asyncio.sleep(LABEL_BACKOFF_S * 2 ** (attempt - 1))
        try:
            on_write("gpureservations", "patch")
            await kube.merge_patch(
                reservations_path(created.namespace, created.name),
                {"metadata": {"labels": {LABEL_COMMITTED: "true"}}},
            )
            return
        except ApiError as exc:
            if exc.not_found:
                return  # withdrawn or ended meanwhile: nothing to label
            error = str(exc)
        except (OSError, TimeoutError) as exc:
            error = str(exc)
    log.warning(
        "reservation committed but not labelled",
        reservation=created.key,
        attempts=LABEL_ATTEMPTS,
        error=error,
    )


async def withdraw(
    kube: KubeClient,
    created: GpuReservation,
    *,
    unplace: bool = False,
    on_write: Callable[[str, str], None],
) -> bool:
    """Delete a booking nobody will use, within a few seconds; one that cannot be deleted (the API
    server is what made us late) expires with the reservation TTL instead. A placed queue entry
    goes back to the queue: its placement is removed, only as `created` left it (another leader
    may have taken the entry over since, and its pod may run on that placement). True when done."""
    path = reservations_path(created.namespace, created.name)
    try:
        if unplace:
            on_write("gpureservations", "patch")
            unplaced = {"nodeName": None, "gpuUUID": None, "gpuIndex": None}
            labels = {LABEL_GPU: None, LABEL_COMMITTED: None}
            meta = {"resourceVersion": created.meta.resource_version, "labels": labels}
            await asyncio.wait_for(
                kube.merge_patch(path, {"metadata": meta, "spec": unplaced}), WITHDRAW_TIMEOUT_S
            )
            log.info("placement withdrawn; the entry is back in the queue", reservation=created.key)
            return True
        if created.waits_for_pod_gone:
            # Its pod will never exist: nothing to wait for. Without this a deleted booking would
            # stay (and count) until the controller saw it ended.
            on_write("gpureservations", "patch")
            await asyncio.wait_for(
                kube.json_patch(path, remove_finalizer(created.meta, FINALIZER_POD_GONE)),
                WITHDRAW_TIMEOUT_S,
            )
        on_write("gpureservations", "delete")
        await asyncio.wait_for(kube.delete(path), WITHDRAW_TIMEOUT_S)
        return True
    except ApiError as exc:
        if unplace and exc.conflict:
            log.info("placement not withdrawn: the entry changed meanwhile", reservation=created.key)
        elif not exc.not_found:
            log.warning("booking not withdrawn; it expires", reservation=created.key, error=str(exc))
    except (TimeoutError, OSError) as exc:
        log.warning("booking not withdrawn; it expires", reservation=created.key, error=repr(exc))
    return False
