"""The fake GPU fleet: nodes, their GPUs with stable UUIDs, and the node labels a real cluster has.

A fleet is plain data, saved as JSON so the fake exporter keeps its state across a stop and start.
"""

from __future__ import annotations

import json
import uuid as uuidlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

_UUID_NAMESPACE = uuidlib.UUID("8d5e4f6a-1b2c-4d3e-9f00-766172736861")


def stable_gpu_uuid(node: str, index: int, generation: int = 0) -> str:
    """A UUID in NVIDIA's 'GPU-<uuid>' form, the same every run for the same node, index and card."""
    return f"GPU-{uuidlib.uuid5(_UUID_NAMESPACE, f'{node}/{index}/{generation}')}"


@dataclass(kw_only=True)
class FakeGpu:
    uuid: str
    index: int
    model: str
    total_mib: int
    used_mib: int = 0
    driver_reserved_mib: int = 0
    silent: bool = False
    """Left out of the exporter's metrics while the card stays (a DCGM series that blinks out)."""
    mig: list[dict[str, Any]] = field(default_factory=list)
    """MIG GPU instances, e.g. {"profile": "3g.20gb", "instance_id": 1, "total_mib": 19968, "used_mib": 0};
    empty for a whole GPU."""
    mig_fb: bool = True
    """False: the exporter writes no framebuffer fields for the instances (dcgm-exporter #512)."""
    pods: list[str] = field(default_factory=list)
    """namespace/name of the pods dcgm-exporter's Kubernetes mapping attributes the GPU to (devices a
    device plugin allocated): one series per pod, with its pod, namespace and container labels."""

    @property
    def free_mib(self) -> int:
        return max(0, self.total_mib - self.driver_reserved_mib - self.used_mib)

    @property
    def pci_bus_id(self) -> str:
        return f"00000000:{0x07 + self.index * 8:02X}:00.0"


@dataclass(kw_only=True)
class FakeNode:
    name: str
    gpus: list[FakeGpu]
    labels: dict[str, str] = field(default_factory=dict)
    real: bool = False
    """A node a real kubelet runs (vramshare_e2e.node): not created for kwok; its GPUs are still fake."""

    def node_labels(self) -> dict[str, str]:
        """The labels a real GPU node carries (GPU feature discovery, kubelet), plus our own."""
        first = self.gpus[0] if self.gpus else None
        labels = {
            "kubernetes.io/hostname": self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "type": "kwok",
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.count": str(len(self.gpus)),
        }
        if first is not None:
            labels["nvidia.com/gpu.product"] = first.model.replace(" ", "-")
            labels["nvidia.com/gpu.memory"] = str(first.total_mib)
        labels.update(self.labels)
        return labels


@dataclass(kw_only=True)
class Fleet:
    nodes: list[FakeNode]
    driver_version: str = "550.54.15"
    report_driver_reserved: bool = True
    """False mimics exporter versions that do not publish DCGM_FI_DEV_FB_RESERVED."""
    exporter_flavour: str = "4.5.3-4.8.2"
    """Which exporter family the fake exporter writes as (see vramshare_e2e.fake_dcgm.FLAVOURS)."""

    def gpu(self, uuid: str) -> tuple[FakeNode, FakeGpu]:
        for node in self.nodes:
            for gpu in node.gpus:
                if gpu.uuid == uuid:
                    return node, gpu
        raise KeyError(uuid)

    def all_gpus(self) -> list[tuple[FakeNode, FakeGpu]]:
        return [(node, gpu) for node in self.nodes for gpu in node.gpus]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Fleet:
        nodes = [
            FakeNode(
                name=n["name"],
                labels=dict(n.get("labels", {})),
                gpus=[FakeGpu(**g) for g in n["gpus"]],
                real=bool(n.get("real", False)),
            )
            for n in data["nodes"]
        ]
        return cls(
            nodes=nodes,
            driver_version=data.get("driver_version", "550.54.15"),
            report_driver_reserved=data.get("report_driver_reserved", True),
            exporter_flavour=data.get("exporter_flavour", "4.5.3-4.8.2"),
        )

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Fleet:
        return cls.from_json(json.loads(path.read_text()))


def uniform_gpus(
    node: str, count: int, *, model: str, total_mib: int, driver_reserved_mib: int
) -> list[FakeGpu]:
    return [
        FakeGpu(
            uuid=stable_gpu_uuid(node, i),
            index=i,
            model=model,
            total_mib=total_mib,
            driver_reserved_mib=driver_reserved_mib,
        )
        for i in range(count)
    ]


def default_fleet() -> Fleet:
    """Two nodes with different GPU counts and sizes: 2 x A100 40 GB and 3 x T4 16 GB."""
    return Fleet(
        nodes=[
            FakeNode(
                name="gpu-node-a",
                gpus=uniform_gpus(
                    "gpu-node-a", 2, model="NVIDIA A100-SXM4-40GB", total_mib=40_960, driver_reserved_mib=512
                ),
            ),
            FakeNode(
                name="gpu-node-b",
                gpus=uniform_gpus(
                    "gpu-node-b", 3, model="Tesla T4", total_mib=15_360, driver_reserved_mib=256
                ),
            ),
        ]
    )
