"""The exporter's NVML mode, against a stand-in `pynvml` module (no GPU on CI machines).

It checks what our code does with NVML's answers: bytes to MiB, v2 memory info with `reserved`, the
fallback to v1 when the driver has no v2, and bytes-or-str strings. Real hardware is exercised only
where a GPU machine is lent.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from vramshare_e2e.fake_dcgm import nvml_readings, render_metrics

MiB = 2**20


@pytest.fixture
def fake_pynvml(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    state: dict[str, Any] = {"v2": True, "calls": []}
    module = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def memory(handle: int, version: int | None = None) -> Any:
        if version is not None and not state["v2"]:
            raise NVMLError("Function Not Found")
        info = types.SimpleNamespace(total=81_559 * MiB, free=70_000 * MiB, used=11_000 * MiB)
        if version is not None:
            info.reserved = 559 * MiB
        return info

    module.NVMLError = NVMLError  # type: ignore[attr-defined]
    module.nvmlMemory_v2 = 2  # type: ignore[attr-defined]
    module.nvmlInit = lambda: state["calls"].append("init")  # type: ignore[attr-defined]
    module.nvmlShutdown = lambda: state["calls"].append("shutdown")  # type: ignore[attr-defined]
    module.nvmlSystemGetDriverVersion = lambda: b"560.35.03"  # type: ignore[attr-defined]
    module.nvmlDeviceGetCount = lambda: 1  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    module.nvmlDeviceGetMemoryInfo = memory  # type: ignore[attr-defined]
    module.nvmlDeviceGetUUID = lambda h: "GPU-real-1"  # type: ignore[attr-defined]
    module.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=b"00000000:17:00.0")  # type: ignore[attr-defined]
    module.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return state


def test_nvml_readings_in_mib_with_reserved(fake_pynvml: dict[str, Any]) -> None:
    (r,) = nvml_readings("node-x")
    assert (r.uuid, r.model, r.pci_bus_id, r.driver_version, r.hostname) == (
        "GPU-real-1",
        "NVIDIA H100 80GB HBM3",
        "00000000:17:00.0",
        "560.35.03",
        "node-x",
    )
    assert (r.free_mib, r.used_mib, r.reserved_mib) == (70_000, 11_000, 559)
    assert fake_pynvml["calls"] == ["init", "shutdown"]
    assert 'DCGM_FI_DEV_FB_RESERVED{gpu="0",UUID="GPU-real-1"' in render_metrics([r])


def test_nvml_without_v2_memory_info_omits_reserved(fake_pynvml: dict[str, Any]) -> None:
    fake_pynvml["v2"] = False
    (r,) = nvml_readings("node-x")
    assert r.reserved_mib is None
    assert "DCGM_FI_DEV_FB_RESERVED{" not in render_metrics([r])
