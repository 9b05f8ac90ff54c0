"""A real node in the local cluster: containerd 2 with runc and a kubelet, registered to the same API
server beside the kwok nodes, running containers on this machine.

Everything stays on this machine: each node has its own address on the loopback interface (see
`NODE_NETWORK`), where its kubelet serves (its own port, so several nodes fit) and its hostNetwork
pods listen; other pods get a loopback-only network (the CNI `loopback` plugin);
nothing can be pulled, so the images a test needs are imported from OCI layout tarballs
(`vramshare_e2e.oci`) and pods use `imagePullPolicy: Never` or `IfNotPresent`.

Facts this machine imposes (see e2e/README.md): cgroup v1 (kubelet 1.35+ needs `failCgroupV1: false`),
the cgroupfs driver (no systemd), root.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from vramshare_e2e.cluster import LocalCluster
from vramshare_e2e.fleet import FakeGpu
from vramshare_e2e.node_gpus import (
    DevicePluginSetup,
    MountNamespace,
    cdi_spec,
    device_plugin_argv,
    device_plugin_env,
    write_cdi_spec,
    write_mock_gpus,
)
from vramshare_e2e.node_images import (
    PAUSE_IMAGE,
    node_images,
)
from vramshare_e2e.node_network import claim_address, node_address, release_address
from vramshare_e2e.ports import free_port
from vramshare_e2e.process import ClusterError, Component
from vramshare_e2e.tools import node_bin, tools_bin_dir


@dataclass
class RealNode:
    """One kubelet with its own containerd; `start()` registers it, `stop()` removes its containers."""

    cluster: LocalCluster
    name: str
    """The node's address, 198.18.0.2 and up (see `NODE_NETWORK`): the API server reaches a kubelet
    (logs, exec) through the node's Hostname address, which is its name, so the name itself must be
    an address of this machine."""
    root: Path
    kubelet_port: int
    healthz_port: int
    labels: dict[str, str]
    device_plugin: DevicePluginSetup | None = None
    """NVIDIA's device plugin on the node's mock NVML (`vramshare_e2e.node_gpus`), or none."""
    namespace: MountNamespace | None = field(default=None, init=False)

    @classmethod
    def create(
        cls, cluster: LocalCluster, number: int = 2, *, device_plugin: DevicePluginSetup | None = None
    ) -> RealNode:
        """Node 198.18.0.`number`, with the GPU labels of the fleet's node of that name, if any; with
        `device_plugin`, NVIDIA's device plugin hands its GPUs out too."""
        name = node_address(number)
        root = cluster.workdir / f"node-{name}"
        root.mkdir(parents=True, exist_ok=True)
        fleet_node = next((n for n in cluster.settings.fleet.nodes if n.name == name), None)
        # The kubelet sets kubernetes.io/* itself and refuses most of that prefix from --node-labels.
        labels = {
            k: v
            for k, v in (fleet_node.node_labels() if fleet_node else {}).items()
            if "kubernetes.io" not in k and k != "type"
        }
        return cls(
            cluster=cluster,
            name=name,
            root=root,
            kubelet_port=free_port(),
            healthz_port=free_port(),
            labels={**labels, "vramshare-e2e/real-node": "true"},
            device_plugin=device_plugin,
        )

    @property
    def socket(self) -> Path:
        return self.root / "containerd" / "containerd.sock"

    def _containerd_config(self) -> Path:
        cni = self.root / "cni"
        (cni / "net.d").mkdir(parents=True, exist_ok=True)
        (cni / "net.d" / "10-loopback.conflist").write_text(
            json.dumps(
                {
                    "cniVersion": "1.0.0",
                    "name": "vramshare-loopback",
                    "plugins": [{"type": "loopback"}, {"type": "cni-loopback"}],
                }
            )
        )
        bin_dir = tools_bin_dir()
        config = f"""version = 3
root = "{self.root / "containerd" / "root"}"
state = "{self.root / "containerd" / "state"}"

[grpc]
  address = "{self.socket}"

[plugins."io.containerd.cri.v1.images"]
  # overlayfs, not native: native copies an image's whole root filesystem for every container
  # (the product image's 415 MB took the kubelet's 2-minute CreateContainer deadline with 2 cores).
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{PAUSE_IMAGE}"

[plugins."io.containerd.cri.v1.runtime"]
  # Pod network namespaces under our state folder, not /var/run/netns, so clean-up finds them.
  netns_mounts_under_state_dir = true
  # This machine's root lacks CAP_SYS_RESOURCE, so no process may lower its OOM score below
  # containerd's (the kubelet asks -998 for sandboxes): clamp it, as for rootless containerd.
  restrict_oom_score_adj = true
  cdi_spec_dirs = ["{self.root / "cdi"}"]
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "{bin_dir / "runc"}"
        SystemdCgroup = false
    # NVIDIA's runtime as the handler of the RuntimeClass "nvidia", the default staying runc: the GPU
    # Operator 25.10 layout. It runs in CDI mode (no driver needed), its config in the node's folder.
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.nvidia]
      runtime_type = "io.containerd.runc.v2"
      # Pod annotations that reach the runtime's OCI spec (NVIDIA's runtime reads CDI requests there).
      pod_annotations = ["cdi.k8s.io/*"]
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.nvidia.options]
        BinaryName = "{bin_dir / "nvidia-container-runtime"}"
        SystemdCgroup = false
    # The same runtime hardened as Bottlerocket ships it: the variable refused from unprivileged
    # containers, device-list mounts accepted (the handler of the RuntimeClass "nvidia-hardened").
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.nvidia-hardened]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.nvidia-hardened.options]
        BinaryName = "{self._hardened_runtime()}"
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{bin_dir / "cni"}"]
    conf_dir = "{cni / "net.d"}"

# NRI, for NVIDIA's NRI plugin (the GPU Operator's cdi.nriPluginEnabled): it asks containerd to inject
# the CDI devices a pod's nvidia.cdi.k8s.io annotations name, under whatever runtime runs the container.
[plugins."io.containerd.nri.v1.nri"]
  disable = false
  socket_path = "{self.nri_socket}"
  plugin_path = "{self.root / "nri" / "plugins"}"
  plugin_config_path = "{self.root / "nri" / "conf.d"}"

[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""
        path = self.root / "containerd.toml"
        path.write_text(config)
        return path

    @property
    def nri_socket(self) -> Path:
        return self.root / "nri" / "nri.sock"

    def _hardened_runtime(self) -> Path:
        """NVIDIA's runtime with the hardened config: containerd's runtime options name a binary only,
        so a wrapper sets the config's path."""
        config = self._nvidia_runtime_config(hardened=True)
        path = self.root / "nvidia-container-runtime-hardened"
        runtime = tools_bin_dir() / "nvidia-container-runtime"
        path.write_text(f'#!/bin/sh\nNVIDIA_CTK_CONFIG_FILE_PATH="{config}" exec "{runtime}" "$@"\n')
        path.chmod(0o755)
        return path

    def _nvidia_runtime_config(self, *, hardened: bool = False) -> Path:
        """NVIDIA's runtime in CDI mode, reading the node's CDI specs and handing over to our runc;
        `hardened`: the variable refused from unprivileged containers, device-list mounts accepted."""
        suffix = "-hardened" if hardened else ""
        log = self.cluster.logs_dir / f"nvidia-container-runtime{suffix}-{self.name}.log"
        config = f"""accept-nvidia-visible-devices-envvar-when-unprivileged = {str(not hardened).lower()}
accept-nvidia-visible-devices-as-volume-mounts = {str(hardened).lower()}

[nvidia-container-runtime]
debug = "{log}"
log-level = "info"
mode = "cdi"
runtimes = ["{tools_bin_dir() / "runc"}"]

[nvidia-container-runtime.modes.cdi]
default-kind = "nvidia.com/gpu"
annotation-prefixes = ["cdi.k8s.io/"]
spec-dirs = ["{self.root / "cdi"}"]
"""
        path = self.root / f"nvidia-container-runtime{suffix}.toml"
        path.write_text(config)
        return path

    @property
    def gpus(self) -> list[FakeGpu]:
        fleet_node = next((n for n in self.cluster.settings.fleet.nodes if n.name == self.name), None)
        return list(fleet_node.gpus) if fleet_node else []

    @property
    def mock_gpus(self) -> Path:
        """The node's GPU files, as the mock NVML reads them (`vramshare_e2e.node_gpus`)."""
        return self.root / "mock-nvml"

    def _kubelet_config(self) -> Path:
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": self.name,
            "port": self.kubelet_port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.healthz_port,
            "failCgroupV1": False,
            "failSwapOn": False,
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": f"/{self.cgroup_root}",
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "podLogsDir": str(self.root / "pod-logs"),
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "registerNode": True,
            "serializeImagePulls": False,
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "localStorageCapacityIsolation": False,
            "maxPods": 50,
            "resolvConf": "",
            "clusterDomain": "cluster.local",
            "enforceNodeAllocatable": [],
            "cgroupsPerQOS": True,
            "protectKernelDefaults": False,
            "makeIPTablesUtilChains": False,
        }
        path = self.root / "kubelet.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    @property
    def cgroup_root(self) -> str:
        return f"vramshare-node-{self.name.replace('.', '-')}"

    def _cgroups(self, *, unified: bool = False) -> list[Path]:
        """The node's cgroup in every v1 hierarchy (the kubelet requires them to exist); with `unified`,
        in the hybrid host's cgroup2 mount too, where runc makes a copy of each container's cgroup that
        nobody removes but this clean-up."""
        base = Path("/sys/fs/cgroup")
        return [
            d / self.cgroup_root
            for d in sorted(base.iterdir())
            if d.is_dir() and (unified or d.name != "unified")
        ]

    def start(self, *, timeout_s: float = 120.0, images: Sequence[Path] = ()) -> float:
        """Start containerd, import the images (the node's own and `images`, OCI archives), start the
        kubelet; the seconds until the Node is Ready."""
        started = time.monotonic()
        self.cluster.on_cleanup(self.cleanup)
        claim_address(self.name)
        for cgroup in self._cgroups():
            cgroup.mkdir(exist_ok=True)
        bin_dir = tools_bin_dir()
        mock = write_mock_gpus(self.mock_gpus, self.gpus) if self.device_plugin is not None else None
        write_cdi_spec(self.root / "cdi", cdi_spec(self.gpus, mock_gpus=mock))
        self.namespace = namespace = MountNamespace.create(
            path=self.root / "mount-namespace", device_plugins=self.root / "device-plugins"
        )
        env = {
            **os.environ,
            "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
            # Read by NVIDIA's runtime, which the shim starts with containerd's environment.
            "NVIDIA_CTK_CONFIG_FILE_PATH": str(self._nvidia_runtime_config()),
        }
        containerd = Component(
            name=f"containerd-{self.name}",
            argv=namespace.enter(
                [node_bin("containerd"), f"--config={self._containerd_config()}", "--log-level=warn"]
            ),
            log_path=self.cluster.logs_dir / f"containerd-{self.name}.log",
            ready=lambda: self.socket.exists() and self._ctr("version").returncode == 0,
            env=env,
        )
        self.cluster.add_component(containerd)
        self.nri_socket.parent.mkdir(parents=True, exist_ok=True)
        nri_log = self.cluster.logs_dir / f"nvidia-cdi-nri-{self.name}.log"
        nri = Component(
            name=f"nvidia-cdi-nri-{self.name}",
            argv=[node_bin("nvidia-cdi-nri"), f"--nri-socket={self.nri_socket}"],
            log_path=nri_log,
            ready=lambda: "NRI plugin registered" in nri_log.read_text(errors="replace"),
        )
        self.cluster.add_component(nri)
        for tarball in [*node_images(), *images]:
            # Unpacked now, for the CRI's snapshotter: the first container need not wait for it.
            result = self._ctr("images", "import", "--snapshotter=overlayfs", "--all-platforms", str(tarball))
            if result.returncode != 0:
                raise ClusterError(f"ctr images import {tarball.name} failed: {result.stderr.strip()}")
        kubelet = Component(
            name=f"kubelet-{self.name}",
            argv=namespace.enter(
                [
                    node_bin("kubelet"),
                    f"--config={self._kubelet_config()}",
                    f"--kubeconfig={self.cluster.kubeconfig}",
                    f"--hostname-override={self.name}",
                    f"--node-ip={self.name}",
                    f"--root-dir={self.root / 'kubelet'}",
                    f"--cert-dir={self.root / 'kubelet-pki'}",
                    "--node-labels=" + ",".join(f"{k}={v}" for k, v in sorted(self.labels.items())),
                    "--v=1",
                ]
            ),
            log_path=self.cluster.logs_dir / f"kubelet-{self.name}.log",
            ready=self._node_ready,
            env=env,
        )
        self.cluster.add_component(kubelet, ready_timeout_s=timeout_s)
        if self.device_plugin is not None and mock is not None:
            config = self.root / "nvidia-device-plugin.yaml"
            config.write_text(self.device_plugin.config())
            self.cluster.add_component(
                Component(
                    name=self.device_plugin_component,
                    argv=device_plugin_argv(namespace, config=config),
                    log_path=self.cluster.logs_dir / f"nvidia-device-plugin-{self.name}.log",
                    ready=lambda: self.advertised_gpus() == len(self.gpus) * self.device_plugin_replicas,
                    env=device_plugin_env(mock),
                ),
                ready_timeout_s=timeout_s,
            )
        return time.monotonic() - started

    @property
    def device_plugin_component(self) -> str:
        return f"nvidia-device-plugin-{self.name}"

    @property
    def device_plugin_replicas(self) -> int:
        return self.device_plugin.replicas if self.device_plugin is not None else 0

    def advertised_gpus(self) -> int:
        """`nvidia.com/gpu` in the Node's allocatable (0 while the device plugin has not registered)."""
        with contextlib.suppress(ClusterError, ValueError):
            node = json.loads(self.cluster.kubectl("get", "node", self.name, "-o", "json"))
            return int(node.get("status", {}).get("allocatable", {}).get("nvidia.com/gpu", "0"))
        return 0

    def tag_image(self, source: str, target: str) -> None:
        """A second name for an imported image (an upgrade to a new tag, with no registry to push to)."""
        result = self._ctr("images", "tag", "--force", source, target)
        if result.returncode != 0:
            raise ClusterError(f"ctr images tag {source} {target} failed: {result.stderr.strip()}")

    def cleanup(self) -> None:
        """After containerd and the kubelet stopped: end what they leave behind on this machine, the
        containers and their shims (which detach from containerd), the kubelet's and containerd's
        mounts, and the node's cgroups."""
        for cgroup in self._cgroups(unified=True):
            for procs in sorted(cgroup.rglob("cgroup.procs")) if cgroup.exists() else []:
                for member in procs.read_text().split():
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(member), 9)
        for pid in self._processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        time.sleep(0.2)
        if self.namespace is not None:  # every process in it gone: its mounts go with it
            self.namespace.remove()
        for mount in sorted(self._mounts(), key=len, reverse=True):
            subprocess.run(["umount", "-l", mount], check=False, capture_output=True)
        for cgroup in self._cgroups(unified=True):
            if cgroup.exists():
                for d in sorted(
                    (p for p in cgroup.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True
                ):
                    with contextlib.suppress(OSError):
                        d.rmdir()
                with contextlib.suppress(OSError):
                    cgroup.rmdir()
        release_address(self.name)

    def leftovers(self) -> list[str]:
        """What of this node is still on the machine: its processes (those naming its containerd
        socket: containerd, the kubelet, the shims), mounts under its folder, and cgroups in any
        hierarchy. Empty after `cleanup`."""
        return [
            *(f"process {pid}" for pid in self._processes()),
            *(f"mount {m}" for m in self._mounts()),
            *(f"cgroup {d}" for c in self._cgroups(unified=True) if c.exists() for d in (c, *c.rglob("*/"))),
        ]

    def _processes(self) -> list[int]:
        socket = str(self.socket)
        found = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                with contextlib.suppress(OSError):
                    if socket in (proc / "cmdline").read_bytes().decode(errors="replace"):
                        found.append(int(proc.name))
        return found

    def _mounts(self) -> list[str]:
        mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
        return [m for m in mounts if m.startswith(str(self.root))]

    def running_containers(self, pod: str) -> int:
        """How many containers of pods named `pod` containerd runs on this node now (the runtime's own
        word, not the API server's: a force-deleted pod's containers outlive its object)."""
        # The pod's own containers, not its sandbox (the pause container carries the pod's name too).
        selector = f'labels."io.kubernetes.pod.name"=={pod},labels."io.cri-containerd.kind"==container'
        listed = self._ctr("containers", "list", "--quiet", selector)
        ids = set(listed.stdout.split())
        tasks = self._ctr("tasks", "list").stdout.splitlines()[1:]
        return sum(1 for line in tasks if line.split() and line.split()[0] in ids and "RUNNING" in line)

    def containers_report(self) -> str:
        """containerd's containers and tasks on this node, for a failure's reader."""
        containers, tasks = self._ctr("containers", "list"), self._ctr("tasks", "list")
        return f"{containers.stdout}{containers.stderr}\n{tasks.stdout}{tasks.stderr}"

    def _ctr(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [node_bin("ctr"), f"--address={self.socket}", "--namespace=k8s.io", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )

    def _node_ready(self) -> bool:
        with contextlib.suppress(ClusterError):
            node = json.loads(self.cluster.kubectl("get", "node", self.name, "-o", "json"))
            return any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in node.get("status", {}).get("conditions", [])
            )
        return False
