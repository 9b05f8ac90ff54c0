"""Debug containers (`kubectl debug`, the `pods/ephemeralcontainers` subresource): they see the pod's own
GPUs, or none.

The placement is read from the stored pod (the review's `oldObject`), never from the object the client
sent: on this subresource the API server runs mutating admission on the client's object and restores
the stored labels and annotations only afterwards (the ephemeral-containers strategy's
PrepareForUpdate), so a client that writes `vramshare.io/gpu-uuid: all` into its update would otherwise
choose its debug container's GPUs. The stored placement is then confirmed by the ledger: the booking the
pod's label names must be active, on the first GPU the pod names, for as many GPUs, and bound to this
pod (or, not bound yet, made for a pod of this name). Anything else: the debug container sees no GPU.
"""

from __future__ import annotations

from vramshare.kube.resources import ANNOTATION_GPU_UUID, LABEL_RESERVATION, is_object_name
from vramshare_webhook import review as rv
from vramshare_webhook.admission.context import Context
from vramshare_webhook.decision import Hide, Reason, Skip
from vramshare_webhook.delivery_modes import DEVICE_LIST_VOLUME
from vramshare_webhook.patching import Obj
from vramshare_webhook.pod import GPU_UUID, pod_annotations
from vramshare_webhook.pod_patch import ephemeral_patch


async def debug_containers(request: rv.Request, *, ctx: Context) -> Hide | Skip:
    stored = request.old_object if isinstance(request.old_object, dict) else {}
    gpus = await confirmed_gpus(stored, namespace=request.namespace, ctx=ctx)
    volumes = stored.get("spec", {}).get("volumes") or []
    device_lists = any(isinstance(v, dict) and v.get("name") == DEVICE_LIST_VOLUME for v in volumes)
    ops = ephemeral_patch(request.object, gpus=gpus, device_lists=device_lists)
    return Hide(patch=ops, reason=Reason.EPHEMERAL_CONTAINERS) if ops else Skip(reason=Reason.NO_GPU_REQUEST)


async def confirmed_gpus(stored: Obj, *, namespace: str, ctx: Context) -> tuple[str, ...]:
    """The GPUs the stored pod was placed on, as its booking confirms them; () when it has none."""
    meta = stored.get("metadata")
    meta = meta if isinstance(meta, dict) else {}
    labels = meta.get("labels")
    label = labels.get(LABEL_RESERVATION) if isinstance(labels, dict) else None
    uuids = tuple(pod_annotations(stored).get(ANNOTATION_GPU_UUID, "").split(","))
    if not isinstance(label, str) or not is_object_name(label) or not all(GPU_UUID.match(u) for u in uuids):
        return ()
    booking = await ctx.ledger.get_reservation(namespace, label)
    if booking is None or not booking.phase.is_active:
        return ()
    bound = booking.status.pod_uid
    mine = bound == meta.get("uid") if bound else booking.spec.pod_name == meta.get("name")
    if not mine or booking.spec.gpu_uuid != uuids[0] or booking.spec.gpu_count != len(uuids):
        return ()
    return uuids
