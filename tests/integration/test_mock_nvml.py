"""The mock NVML the real nodes run NVIDIA's device plugin on (e2e/tools/mock-nvml), read through NVIDIA's
own Python binding (nvidia-ml-py, what vramshare's holder uses): it shows exactly the GPU files it is
given, as the real library shows the device nodes a container is given, and answers as NVML does where
there is no driver."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from vramshare_e2e.fleet import FakeGpu
from vramshare_e2e.node_gpus import mock_nvml_library, write_mock_gpus

PROBE = """
import json, pynvml
try:
    pynvml.nvmlInit()
except pynvml.NVMLError as exc:
    print(json.dumps({"error": str(exc)})); raise SystemExit
out = {"driver": pynvml.nvmlSystemGetDriverVersion(), "gpus": []}
for i in range(pynvml.nvmlDeviceGetCount()):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    mem = pynvml.nvmlDeviceGetMemoryInfo(h)
    out["gpus"].append({"uuid": pynvml.nvmlDeviceGetUUID(h), "name": pynvml.nvmlDeviceGetName(h),
                        "total_mib": mem.total >> 20, "minor": pynvml.nvmlDeviceGetMinorNumber(h),
                        "bus": pynvml.nvmlDeviceGetPciInfo(h).busId})
try:
    pynvml.nvmlDeviceGetMigMode(pynvml.nvmlDeviceGetHandleByIndex(0))
except pynvml.NVMLError as exc:
    out["mig"] = str(exc)
pynvml.nvmlShutdown()
print(json.dumps(out))
"""


def probe(root: Path) -> dict[str, object]:
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(mock_nvml_library().parent),
        "VRAMSHARE_MOCK_NVML_ROOT": str(root),
    }
    result = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    out: dict[str, object] = json.loads(result.stdout)
    return out


def gpu(index: int, uuid: str) -> FakeGpu:
    return FakeGpu(uuid=uuid, index=index, model="NVIDIA H100 80GB HBM3", total_mib=81_559)


def test_nvml_shows_exactly_the_gpu_files_it_is_given_in_index_order(tmp_path: Path) -> None:
    root = write_mock_gpus(tmp_path / "gpus", [gpu(1, "GPU-bbbb"), gpu(0, "GPU-aaaa")])
    seen = probe(root)
    assert seen["driver"] == "580.95.05"
    assert seen["gpus"] == [
        {
            "uuid": "GPU-aaaa",
            "name": "NVIDIA H100 80GB HBM3",
            "total_mib": 81_559,
            "minor": 0,
            "bus": "00000000:01:00.0",
        },
        {
            "uuid": "GPU-bbbb",
            "name": "NVIDIA H100 80GB HBM3",
            "total_mib": 81_559,
            "minor": 1,
            "bus": "00000000:02:00.0",
        },
    ]
    assert seen["mig"] == "Not Supported"
    # A container given one GPU's file sees that GPU alone.
    (root / "0").unlink()
    assert [g["uuid"] for g in probe(root)["gpus"]] == ["GPU-bbbb"]  # type: ignore[index]


def test_without_gpu_files_nvml_answers_as_a_machine_without_the_driver(tmp_path: Path) -> None:
    assert probe(tmp_path / "absent") == {"error": "Driver Not Loaded"}
