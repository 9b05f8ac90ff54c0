"""A real node's GPUs as its containers and NVIDIA's device plugin see them, with no GPU on the machine.

- **The mock NVML** (`e2e/tools/mock-nvml`): `libnvidia-ml.so.1` that enumerates GPU files, one per GPU
  (`<index>`: uuid, name, memory), as the real library enumerates device nodes. The node's folder holds
  every GPU's file; a container is given the files of the GPUs it got, and the library, by the node's
  CDI spec, as `nvidia-ctk cdi generate` gives the driver's library and device nodes.
- **The CDI spec** NVIDIA's runtime reads: the GPUs by index, by UUID and `all`.
- **NVIDIA's device plugin** (`nvidia-device-plugin`, built from its module), run as the GPU Operator
  runs it, on the mock NVML, registering `nvidia.com/gpu` with the node's kubelet; optionally with
  time-slicing replicas (its own config file's `sharing.timeSlicing`).
- **The node's mount namespace**: the kubelet serves its device-plugin socket at a path compiled in
  (`/var/lib/kubelet/device-plugins/kubelet.sock`, whatever `--root-dir` says), and so does the device
  plugin. Two kubelets on one machine would take each other's socket; each node's containerd, kubelet
  and device plugin run in a mount namespace of the node's own, where that folder is the node's.
  Mounts made there (volumes, snapshots) never show on the machine, and go with the namespace.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from vramshare_e2e.fleet import FakeGpu
from vramshare_e2e.process import ClusterError
from vramshare_e2e.tools import node_bin, tools_bin_dir

KUBELET_DEVICE_PLUGINS = Path("/var/lib/kubelet/device-plugins")
"""Where the kubelet and every device plugin expect each other's sockets (compiled into both)."""
MOCK_NVML_IN_CONTAINER = "/run/vramshare-mock-nvml"
"""Where the mock NVML looks for GPU files by default: a container's own GPUs are mounted there."""
NVML_IN_CONTAINER = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
"""Where `nvidia-ctk cdi generate` mounts the driver's NVML into a container (Debian's library path)."""


def mock_nvml_library() -> Path:
    return tools_bin_dir() / "mock-nvml" / "libnvidia-ml.so.1"


@dataclass(frozen=True, slots=True, kw_only=True)
class DevicePluginSetup:
    """How NVIDIA's device plugin runs on a node."""

    replicas: int = 1
    """Time-slicing replicas per GPU (its config's sharing.timeSlicing); 1: each GPU handed out whole."""

    def config(self) -> str:
        """The plugin's config file: GPUs listed by UUID in NVIDIA_VISIBLE_DEVICES (its default
        strategy, which NVIDIA's runtime turns into the CDI devices of those UUIDs)."""
        config: dict[str, object] = {
            "version": "v1",
            "flags": {
                "migStrategy": "none",
                "plugin": {"deviceListStrategy": ["envvar"], "deviceIDStrategy": "uuid"},
            },
        }
        if self.replicas > 1:
            config["sharing"] = {
                "timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": self.replicas}]}
            }
        return yaml.safe_dump(config)


def write_mock_gpus(folder: Path, gpus: Sequence[FakeGpu]) -> Path:
    """One file per GPU, as the mock NVML reads them."""
    folder.mkdir(parents=True, exist_ok=True)
    for gpu in gpus:
        (folder / str(gpu.index)).write_text(
            f"uuid={gpu.uuid}\nname={gpu.model}\nmemory_mib={gpu.total_mib}\nminor={gpu.index}\n"
        )
    return folder


def cdi_spec(gpus: Sequence[FakeGpu], *, mock_gpus: Path | None) -> dict[str, object]:
    """The node's fake GPUs as nvidia-ctk names them: by index, by UUID, and `all`. A device's edits
    give the container `VRAMSHARE_FAKE_GPU_<index>=<UUID>` (what it really got, for its log to tell)
    and, with `mock_gpus`, its GPU's file for the mock NVML, which the spec mounts in every container
    that gets a GPU, where the runtime mounts the driver's."""

    def edits(selected: Sequence[FakeGpu]) -> dict[str, object]:
        out: dict[str, object] = {"env": [f"VRAMSHARE_FAKE_GPU_{g.index}={g.uuid}" for g in selected]}
        if mock_gpus is not None:
            out["mounts"] = [
                {
                    "hostPath": str(mock_gpus / str(g.index)),
                    "containerPath": f"{MOCK_NVML_IN_CONTAINER}/{g.index}",
                    "options": ["ro", "nosuid", "nodev", "bind"],
                }
                for g in selected
            ]
        return out

    devices = [{"name": str(g.index), "containerEdits": edits([g])} for g in gpus]
    devices += [{"name": g.uuid, "containerEdits": edits([g])} for g in gpus]
    devices.append({"name": "all", "containerEdits": edits(gpus)})
    spec: dict[str, object] = {"cdiVersion": "0.6.0", "kind": "nvidia.com/gpu", "devices": devices}
    if mock_gpus is not None:
        spec["containerEdits"] = {
            "mounts": [
                {
                    "hostPath": str(mock_nvml_library()),
                    "containerPath": NVML_IN_CONTAINER,
                    "options": ["ro", "nosuid", "nodev", "bind"],
                }
            ]
        }
    return spec


def write_cdi_spec(folder: Path, spec: dict[str, object]) -> Path:
    path = folder / "nvidia.com-gpu.json"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec, indent=2))
    return path


@dataclass(frozen=True, slots=True)
class MountNamespace:
    """A node's own mount namespace, kept by a bind mount of it on `path` (as `ip netns` keeps network
    namespaces), where `KUBELET_DEVICE_PLUGINS` is the node's `device_plugins` folder."""

    path: Path

    @classmethod
    def create(cls, *, path: Path, device_plugins: Path) -> MountNamespace:
        device_plugins.mkdir(parents=True, exist_ok=True)
        # The mount point must exist on the machine; a GPU node has it, this machine may not.
        KUBELET_DEVICE_PLUGINS.mkdir(parents=True, exist_ok=True)
        path.touch()
        result = subprocess.run(
            [
                "unshare",
                f"--mount={path}",
                "--propagation=private",
                "mount",
                "--bind",
                str(device_plugins),
                str(KUBELET_DEVICE_PLUGINS),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise ClusterError(f"the node's mount namespace: {result.stderr.strip()}")
        return cls(path=path)

    def enter(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside the namespace (nsenter execs it: its command line stays its own)."""
        return ["nsenter", f"--mount={self.path}", "--", *argv]

    def remove(self) -> None:
        """After every process in it has gone: its mounts go with it."""
        subprocess.run(["umount", str(self.path)], check=False, capture_output=True)
        with contextlib.suppress(OSError):
            self.path.unlink()


def device_plugin_argv(namespace: MountNamespace, *, config: Path) -> list[str]:
    return namespace.enter(
        [node_bin("nvidia-device-plugin"), f"--config-file={config}", "--fail-on-init-error=true"]
    )


def device_plugin_env(mock_gpus: Path) -> dict[str, str]:
    """The plugin finds NVML as the GPU Operator's container does (libnvidia-ml.so.1 on the library
    path), here the mock, reading the node's GPU files."""
    return {
        **os.environ,
        "LD_LIBRARY_PATH": str(mock_nvml_library().parent),
        "VRAMSHARE_MOCK_NVML_ROOT": str(mock_gpus),
    }
