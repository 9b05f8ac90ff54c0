"""A DCGM-compatible exporter for a fake GPU fleet, with a control API for tests.

It serves the framebuffer gauges of NVIDIA's dcgm-exporter with the same names, labels and label order
as its `render_metrics.go` template, in one of several *flavours*, one per exporter family users run
(the fleet's `exporter_flavour`; see FLAVOURS and tests/unit/dcgm_corpus/README.md for the sources):

    4.5.3-4.8.2      Hostname, MiB gauges, DCGM_FI_DRIVER_VERSION label (up to 2026-05)
    4.6.0-4.8.3      hostname (PR #655), MiB gauges
    dcgm-4.7-bytes   hostname, DCGM 4.7's byte-exact fields with FB_CAPACITY_BYTES, and the driver
                     label under DCGM_FI_SYSTEM_DRIVER_VERSION
    pod-hostname     Hostname holds the exporter pod's name (exporters before 2023)

A GPU with `mig` instances is written as a MIG-enabled GPU is: one series per GPU instance with the
parent's UUID plus GPU_I_PROFILE and GPU_I_ID (framebuffer figures per instance, left out with
`mig_fb: false` as on some H100 set-ups), and DCGM_FI_PROF_GR_ENGINE_ACTIVE per instance.

Control API (JSON), used by tests and the demo:

    GET    /fleet                          the fleet as JSON
    PUT    /gpus/{uuid}        {"used_mib": N}   set a GPU's used memory
    PUT    /flavour            {"flavour": "4.6.0-4.8.3"}  write the metrics as that exporter does
    DELETE /gpus/{uuid}                    remove a GPU (card pulled, node gone)
    POST   /gpus/{uuid}/replace {"uuid": "GPU-..."}  the card is replaced: same slot, new UUID

Every change is written back to the fleet file, so a stopped and restarted exporter keeps its state.

With `--nvml` it instead reads real GPUs through NVML (`nvidia-ml-py`), so on a machine with an NVIDIA
GPU it doubles as a minimal DCGM-compatible exporter.

    python -m vramshare_e2e.fake_dcgm --fleet fleet.json --port 9400
"""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from vramshare_e2e.fleet import Fleet


@dataclass(frozen=True, kw_only=True)
class Flavour:
    """How one exporter family writes the framebuffer gauges."""

    node_label: str
    metrics: tuple[tuple[str, str, str], ...]
    """(metric, which figure: free/used/reserved/capacity, HELP text)."""
    bytes_per_unit: int
    driver_label: str
    hostname_is_pod: bool = False


_MIB_METRICS = (
    ("DCGM_FI_DEV_FB_FREE", "free", "Framebuffer memory free (in MiB)."),
    ("DCGM_FI_DEV_FB_USED", "used", "Framebuffer memory used (in MiB)."),
    ("DCGM_FI_DEV_FB_RESERVED", "reserved", "Framebuffer memory reserved (in MiB)."),
)
_BYTES_METRICS = (
    ("DCGM_FI_DEV_FB_CAPACITY_BYTES", "capacity", "Total framebuffer memory (in bytes)."),
    ("DCGM_FI_DEV_FB_FREE_BYTES", "free", "Framebuffer memory free (in bytes)."),
    ("DCGM_FI_DEV_FB_USED_BYTES", "used", "Framebuffer memory used (in bytes)."),
    ("DCGM_FI_DEV_FB_RESERVED_BYTES", "reserved", "Framebuffer memory reserved (in bytes)."),
)
FLAVOURS = {
    "4.5.3-4.8.2": Flavour(
        node_label="Hostname",
        metrics=_MIB_METRICS,
        bytes_per_unit=2**20,
        driver_label="DCGM_FI_DRIVER_VERSION",
    ),
    "4.6.0-4.8.3": Flavour(
        node_label="hostname",
        metrics=_MIB_METRICS,
        bytes_per_unit=2**20,
        driver_label="DCGM_FI_DRIVER_VERSION",
    ),
    "dcgm-4.7-bytes": Flavour(
        node_label="hostname",
        metrics=_BYTES_METRICS,
        bytes_per_unit=1,
        driver_label="DCGM_FI_SYSTEM_DRIVER_VERSION",
    ),
    "pod-hostname": Flavour(
        node_label="Hostname",
        metrics=_MIB_METRICS,
        bytes_per_unit=2**20,
        driver_label="DCGM_FI_DRIVER_VERSION",
        hostname_is_pod=True,
    ),
}
DEFAULT_FLAVOUR = "4.5.3-4.8.2"


@dataclass(frozen=True, kw_only=True)
class InstanceReading:
    """One GPU instance of a MIG-enabled GPU."""

    profile: str
    instance_id: int
    free_mib: int | None
    used_mib: int | None


@dataclass(frozen=True, kw_only=True)
class GpuReading:
    """One GPU's framebuffer figures and identity, whatever they were read from."""

    index: int
    uuid: str
    pci_bus_id: str
    model: str
    hostname: str
    driver_version: str
    free_mib: int
    used_mib: int
    reserved_mib: int | None
    mig: tuple[InstanceReading, ...] = ()
    pods: tuple[str, ...] = ()
    """namespace/name of the pods the exporter's Kubernetes mapping attributes the GPU to."""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _pod_name(hostname: str) -> str:
    """A DaemonSet pod name, as old exporters wrote into Hostname."""
    return f"nvidia-dcgm-exporter-{hashlib.sha256(hostname.encode()).hexdigest()[:5]}"


def render_metrics(readings: Iterable[GpuReading], *, flavour: str = DEFAULT_FLAVOUR) -> str:
    """The Prometheus text exposition that exporter family would serve for these readings."""
    shape = FLAVOURS[flavour]
    readings = list(readings)
    lines: list[str] = []

    def series(r: GpuReading, instance: InstanceReading | None) -> str:
        labels = {
            "gpu": str(r.index),
            "UUID": r.uuid,
            "pci_bus_id": r.pci_bus_id,
            "device": f"nvidia{r.index}",
            "modelName": r.model,
        }
        if instance is not None:
            labels |= {"GPU_I_PROFILE": instance.profile, "GPU_I_ID": str(instance.instance_id)}
        labels[shape.node_label] = _pod_name(r.hostname) if shape.hostname_is_pod else r.hostname
        labels[shape.driver_label] = r.driver_version
        return ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())

    for metric, figure, help_text in shape.metrics:
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} gauge"]
        for r in readings:
            if r.mig:
                for i in r.mig:
                    if i.free_mib is None or i.used_mib is None or figure == "reserved":
                        continue
                    value = {"free": i.free_mib, "used": i.used_mib, "capacity": i.free_mib + i.used_mib}[
                        figure
                    ]
                    lines.append(f"{metric}{{{series(r, i)}}} {value * 2**20 // shape.bytes_per_unit}")
                continue
            mib = {
                "free": r.free_mib,
                "used": r.used_mib,
                "reserved": r.reserved_mib,
                "capacity": r.free_mib + r.used_mib + (r.reserved_mib or 0),
            }[figure]
            if mib is None:
                continue
            value = mib * 2**20 // shape.bytes_per_unit
            # dcgm-exporter repeats a GPU's series once per pod it maps the GPU to, with its labels.
            pods: tuple[str | None, ...] = r.pods or (None,)
            for pod in pods:
                attributed = ""
                if pod is not None:
                    namespace, _, name = pod.partition("/")
                    attributed = f',pod="{_escape(name)}",namespace="{_escape(namespace)}",container="main"'
                lines.append(f"{metric}{{{series(r, None)}{attributed}}} {value}")
    instances = [(r, i) for r in readings for i in r.mig]
    if instances:
        metric = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
        lines += [f"# HELP {metric} Ratio of time the graphics engine is active.", f"# TYPE {metric} gauge"]
        lines += [f"{metric}{{{series(r, i)}}} 0.000000" for r, i in instances]
    return "\n".join(lines) + "\n"


def fleet_readings(fleet: Fleet) -> list[GpuReading]:
    return [
        GpuReading(
            index=gpu.index,
            uuid=gpu.uuid,
            pci_bus_id=gpu.pci_bus_id,
            model=gpu.model,
            hostname=node.name,
            driver_version=fleet.driver_version,
            free_mib=gpu.free_mib,
            used_mib=gpu.used_mib,
            reserved_mib=gpu.driver_reserved_mib if fleet.report_driver_reserved else None,
            mig=tuple(
                InstanceReading(
                    profile=i["profile"],
                    instance_id=int(i["instance_id"]),
                    free_mib=int(i["total_mib"]) - int(i.get("used_mib", 0)) if gpu.mig_fb else None,
                    used_mib=int(i.get("used_mib", 0)) if gpu.mig_fb else None,
                )
                for i in gpu.mig
            ),
            pods=tuple(gpu.pods),
        )
        for node, gpu in fleet.all_gpus()
        if not gpu.silent
    ]


def nvml_readings(hostname: str) -> list[GpuReading]:  # pragma: no cover - needs a real GPU
    """Real framebuffer figures through NVML, in MiB as DCGM reports them."""
    import pynvml  # type: ignore[import-untyped]  # optional extra: vramshare-e2e[nvml]

    pynvml.nvmlInit()
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        readings = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            try:
                mem = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
                reserved: int | None = mem.reserved // 2**20
            except (pynvml.NVMLError, AttributeError, TypeError):
                mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
                reserved = None
            readings.append(
                GpuReading(
                    index=i,
                    uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                    pci_bus_id=_text(pynvml.nvmlDeviceGetPciInfo(handle).busId),
                    model=_text(pynvml.nvmlDeviceGetName(handle)),
                    hostname=hostname,
                    driver_version=_text(driver),
                    free_mib=mem.free // 2**20,
                    used_mib=mem.used // 2**20,
                    reserved_mib=reserved,
                )
            )
        return readings
    finally:
        pynvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


FLEET_KEY = web.AppKey("fleet_path", Path)


def create_app(
    *, fleet_path: Path | None, read: Callable[[], list[GpuReading]] | None = None
) -> web.Application:
    """The exporter: `/metrics` from the fleet file (or from `read`, e.g. NVML) plus the control API."""
    app = web.Application()

    def load() -> Fleet:
        assert fleet_path is not None
        return Fleet.load(fleet_path)

    async def metrics(_: web.Request) -> web.Response:
        if read is not None:
            text = render_metrics(read())
        else:
            fleet = load()
            text = render_metrics(fleet_readings(fleet), flavour=fleet.exporter_flavour)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def set_flavour(request: web.Request) -> web.Response:
        flavour = str((await request.json()).get("flavour", ""))
        if flavour not in FLAVOURS:
            return web.json_response({"error": f"flavour must be one of {', '.join(FLAVOURS)}"}, status=400)
        fleet = load()
        fleet.exporter_flavour = flavour
        assert fleet_path is not None
        fleet.save(fleet_path)
        return web.json_response(fleet.to_json())

    async def get_fleet(_: web.Request) -> web.Response:
        return web.json_response(load().to_json())

    def change(request: web.Request, mutate: Callable[[Fleet, str], None]) -> web.Response:
        fleet = load()
        uuid = request.match_info["uuid"]
        try:
            mutate(fleet, uuid)
        except KeyError:
            return web.json_response({"error": f"no GPU with UUID {uuid}"}, status=404)
        except (TypeError, ValueError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        assert fleet_path is not None
        fleet.save(fleet_path)
        return web.json_response(fleet.to_json())

    async def set_used(request: web.Request) -> web.Response:
        body = await request.json()

        def mutate(fleet: Fleet, uuid: str) -> None:
            _, gpu = fleet.gpu(uuid)
            used = int(body["used_mib"])
            if not 0 <= used <= gpu.total_mib - gpu.driver_reserved_mib:
                raise ValueError(f"used_mib must be between 0 and {gpu.total_mib - gpu.driver_reserved_mib}")
            gpu.used_mib = used

        return change(request, mutate)

    async def set_pods(request: web.Request) -> web.Response:
        body = await request.json()

        def mutate(fleet: Fleet, uuid: str) -> None:
            pods = [str(p) for p in body["pods"]]
            if not all(p.count("/") == 1 for p in pods):
                raise ValueError("pods are namespace/name")
            fleet.gpu(uuid)[1].pods = pods

        return change(request, mutate)

    async def remove(request: web.Request) -> web.Response:
        def mutate(fleet: Fleet, uuid: str) -> None:
            node, gpu = fleet.gpu(uuid)
            node.gpus.remove(gpu)

        return change(request, mutate)

    async def silence(request: web.Request) -> web.Response:
        body = await request.json()

        def mutate(fleet: Fleet, uuid: str) -> None:
            fleet.gpu(uuid)[1].silent = bool(body["silent"])

        return change(request, mutate)

    async def replace(request: web.Request) -> web.Response:
        body = await request.json()

        def mutate(fleet: Fleet, uuid: str) -> None:
            _, gpu = fleet.gpu(uuid)
            gpu.uuid = str(body["uuid"])
            gpu.used_mib = 0

        return change(request, mutate)

    app.router.add_get("/metrics", metrics)
    if read is None:
        app.router.add_get("/fleet", get_fleet)
        app.router.add_put("/gpus/{uuid}", set_used)
        app.router.add_delete("/gpus/{uuid}", remove)
        app.router.add_post("/gpus/{uuid}/replace", replace)
        app.router.add_put("/gpus/{uuid}/silent", silence)
        app.router.add_put("/gpus/{uuid}/pods", set_pods)
        app.router.add_put("/flavour", set_flavour)
    return app


class ExporterClient:
    """Drives a running fake exporter's control API (synchronous, for tests and the demo)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"{self.url}{path}", data=data, method=method)
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def fleet(self) -> Fleet:
        return Fleet.from_json(self._call("GET", "/fleet"))

    def set_used(self, uuid: str, used_mib: int) -> None:
        self._call("PUT", f"/gpus/{uuid}", {"used_mib": used_mib})

    def remove_gpu(self, uuid: str) -> None:
        self._call("DELETE", f"/gpus/{uuid}")

    def set_silent(self, uuid: str, silent: bool) -> None:
        """Stop (or resume) reporting one GPU's series, as an exporter whose DCGM field blinks."""
        self._call("PUT", f"/gpus/{uuid}/silent", {"silent": silent})

    def set_pods(self, uuid: str, pods: list[str]) -> None:
        """The pods (namespace/name) the exporter's Kubernetes mapping attributes the GPU to."""
        self._call("PUT", f"/gpus/{uuid}/pods", {"pods": pods})

    def set_flavour(self, flavour: str) -> None:
        """Write the metrics as another exporter family does (see FLAVOURS)."""
        self._call("PUT", "/flavour", {"flavour": flavour})

    def replace_uuid(self, uuid: str, new_uuid: str) -> None:
        self._call("POST", f"/gpus/{uuid}/replace", {"uuid": new_uuid})

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as resp:
            return str(resp.read().decode())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fleet", type=Path, help="fleet JSON file (state is written back to it)")
    parser.add_argument("--nvml", action="store_true", help="read real GPUs through NVML instead of a fleet")
    parser.add_argument("--hostname", default=socket.gethostname(), help="Hostname label in --nvml mode")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9400)
    args = parser.parse_args(argv)
    if args.nvml:
        app = create_app(fleet_path=None, read=lambda: nvml_readings(args.hostname))
    elif args.fleet is not None:
        app = create_app(fleet_path=args.fleet)
    else:
        parser.error("give --fleet FILE or --nvml")
    web.run_app(app, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
