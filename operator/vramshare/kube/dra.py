"""GPUs published for Dynamic Resource Allocation (issue #43): a DRA driver, NVIDIA's among them
(driver gpu.nvidia.com, not GA), lists each node's GPUs in ResourceSlices, and the scheduler hands them
to ResourceClaims whole; it knows nothing of vramshare's bookings. vramshare does not share such a GPU.
Holding one through a ResourceClaim naming the exact device is a later step."""

from __future__ import annotations

from dataclasses import dataclass

from vramshare.kube.client import ApiError, KubeClient, Obj

RESOURCE_API = "/apis/resource.k8s.io/v1"
RESOURCE_SLICES = f"{RESOURCE_API}/resourceslices"


@dataclass(frozen=True, slots=True, kw_only=True)
class DraGpu:
    uuid: str
    driver: str
    slice: str
    node: str


def slice_gpus(obj: Obj) -> tuple[DraGpu, ...]:
    """The GPUs a ResourceSlice lists: devices with a `uuid` attribute (NVIDIA's driver names it so;
    another driver's `<domain>/uuid` too) holding a GPU UUID."""
    spec = obj.get("spec") or {}
    found = []
    for device in spec.get("devices") or []:
        for key, value in (device.get("attributes") or {}).items():
            uuid = (value or {}).get("string") if isinstance(value, dict) else None
            if (key == "uuid" or key.endswith("/uuid")) and isinstance(uuid, str) and uuid.startswith("GPU-"):
                found.append(
                    DraGpu(
                        uuid=uuid,
                        driver=str(spec.get("driver", "")),
                        slice=str((obj.get("metadata") or {}).get("name", "")),
                        node=str(spec.get("nodeName") or ""),
                    )
                )
    return tuple(found)


async def served(kube: KubeClient) -> bool:
    """Whether the API server serves resource.k8s.io/v1 (Kubernetes 1.34 and later)."""
    try:
        await kube.get(RESOURCE_API)
    except ApiError as exc:
        if exc.status in (403, 404):
            return False
        raise
    return True


def dra_reason(gpu: DraGpu) -> str:
    return (
        f"published for Dynamic Resource Allocation by driver {gpu.driver} (ResourceSlice {gpu.slice}): "
        "the scheduler may give it whole to a ResourceClaim and knows nothing of vramshare's bookings; "
        "vramshare does not share it (keep the DRA driver off the nodes you give vramshare)"
    )
