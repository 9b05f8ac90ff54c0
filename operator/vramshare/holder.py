"""vramshare-holder: the process of a holder pod (`vramshare.domain.holds`). NVIDIA's device plugin gave
its pod one GPU; it asks NVML inside its container which one (as KAI Scheduler's reservation pod does:
whatever the plugin's device-list strategy, the container sees only its GPUs), writes the UUID on its
own pod for the controller and the webhook, and then does nothing until it is deleted: while it runs,
the GPU is vramshare's to share.

It exits non-zero, with a message, where NVML shows anything but exactly one GPU (the kubelet restarts
it; the controller leaves such a holder Acquiring).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import structlog

from vramshare.kube.client import Connection, KubeClient
from vramshare.kube.holders import ANNOTATION_HELD_GPU
from vramshare.kube.resources import is_object_name, pod_path
from vramshare.logs import configure

log = structlog.get_logger("vramshare.holder")


class NoSingleGpuError(RuntimeError):
    pass


def visible_gpus() -> list[str]:
    """The UUIDs of the GPUs NVML shows this container, through NVIDIA's Python binding."""
    import pynvml  # type: ignore[import-untyped]  # NVIDIA's nvidia-ml-py: loads libnvidia-ml.so.1

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise NoSingleGpuError(
            f"NVML did not start ({exc}): no GPU was given to this container (its RuntimeClass must be "
            "the one that delivers device-plugin GPUs, e.g. nvidia: setting holder_runtime_class)"
        ) from exc
    try:
        uuids = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index))
            uuids.append(uuid.decode() if isinstance(uuid, bytes) else str(uuid))
        return uuids
    finally:
        pynvml.nvmlShutdown()


def the_gpu(uuids: list[str]) -> str:
    if len(uuids) != 1 or not uuids[0].startswith("GPU-"):
        raise NoSingleGpuError(
            f"NVML shows {len(uuids)} GPUs here ({', '.join(uuids) or 'none'}); a holder requests "
            "nvidia.com/gpu: 1 and must see exactly that one (a device plugin handing out MIG devices "
            "or every GPU?)"
        )
    return uuids[0]


async def hold(*, namespace: str, name: str, uuid: str) -> None:
    async with KubeClient(Connection.load(), user_agent="vramshare-holder") as kube:
        await kube.merge_patch(
            pod_path(namespace, name), {"metadata": {"annotations": {ANNOTATION_HELD_GPU: uuid}}}
        )
    log.info("holding", gpu_uuid=uuid, pod=f"{namespace}/{name}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    log.info("given back", gpu_uuid=uuid)


def main() -> None:
    configure(level=os.environ.get("VRAMSHARE_LOG_LEVEL", "info"))
    namespace, name = os.environ.get("POD_NAMESPACE", ""), os.environ.get("POD_NAME", "")
    if not (is_object_name(namespace) and is_object_name(name)):
        log.error(
            "POD_NAMESPACE and POD_NAME must name this pod (the downward API)", namespace=namespace, name=name
        )
        sys.exit(2)
    try:
        uuid = the_gpu(visible_gpus())
    except NoSingleGpuError as exc:
        log.error("cannot hold a GPU", error=str(exc))
        sys.exit(3)
    asyncio.run(hold(namespace=namespace, name=name, uuid=uuid))


if __name__ == "__main__":
    main()
