"""The fake DCGM exporter's control API and exposition, served for real on loopback."""

from __future__ import annotations

from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from vramshare_e2e.fake_dcgm import create_app
from vramshare_e2e.fleet import Fleet, default_fleet


async def test_control_api_changes_what_metrics_show(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    default_fleet().save(path)
    (_, first), (_, second) = default_fleet().all_gpus()[:2]
    async with TestClient(TestServer(create_app(fleet_path=path))) as http:
        text = await (await http.get("/metrics")).text()
        assert text.count("DCGM_FI_DEV_FB_FREE{") == 5
        assert f'UUID="{first.uuid}"' in text
        assert "# TYPE DCGM_FI_DEV_FB_RESERVED gauge" in text

        assert (await http.put(f"/gpus/{first.uuid}", json={"used_mib": 1000})).status == 200
        text = await (await http.get("/metrics")).text()
        assert f'DCGM_FI_DEV_FB_USED{{gpu="0",UUID="{first.uuid}"' in text
        line = next(x for x in text.splitlines() if x.startswith("DCGM_FI_DEV_FB_FREE") and first.uuid in x)
        assert line.endswith(f" {first.total_mib - first.driver_reserved_mib - 1000}")

        bad = await http.put(f"/gpus/{first.uuid}", json={"used_mib": 10**9})
        assert bad.status == 400
        assert (await http.put("/gpus/GPU-nope", json={"used_mib": 1})).status == 404

        assert (await http.delete(f"/gpus/{second.uuid}")).status == 200
        assert (await http.post(f"/gpus/{first.uuid}/replace", json={"uuid": "GPU-new"})).status == 200
        text = await (await http.get("/metrics")).text()
        assert second.uuid not in text
        assert first.uuid not in text
        assert 'UUID="GPU-new"' in text
    # State survives a restart: it lives in the fleet file.
    reloaded = Fleet.load(path)
    assert next(g.uuid for _, g in reloaded.all_gpus()) == "GPU-new"
    assert len(reloaded.all_gpus()) == 4


async def test_exporters_without_fb_reserved_omit_the_series(tmp_path: Path) -> None:
    fleet = default_fleet()
    fleet.report_driver_reserved = False
    path = tmp_path / "fleet.json"
    fleet.save(path)
    async with TestClient(TestServer(create_app(fleet_path=path))) as http:
        text = await (await http.get("/metrics")).text()
    assert "DCGM_FI_DEV_FB_RESERVED{" not in text
    assert text.count("DCGM_FI_DEV_FB_USED{") == 5


async def test_each_flavour_writes_as_its_exporter_family(tmp_path: Path) -> None:
    fleet = default_fleet()
    _, mig_gpu = fleet.all_gpus()[1]
    mig_gpu.mig = [{"profile": "3g.20gb", "instance_id": 1, "total_mib": 19_968, "used_mib": 12}]
    path = tmp_path / "fleet.json"
    fleet.save(path)
    async with TestClient(TestServer(create_app(fleet_path=path))) as http:
        legacy = await (await http.get("/metrics")).text()
        assert 'Hostname="gpu-node-a",DCGM_FI_DRIVER_VERSION="550.54.15"}' in legacy
        line = next(
            x for x in legacy.splitlines() if x.startswith("DCGM_FI_DEV_FB_USED") and mig_gpu.uuid in x
        )
        assert ',GPU_I_PROFILE="3g.20gb",GPU_I_ID="1",Hostname="gpu-node-a"' in line
        assert line.endswith(" 12")
        assert f'DCGM_FI_PROF_GR_ENGINE_ACTIVE{{gpu="1",UUID="{mig_gpu.uuid}"' in legacy

        assert (await http.put("/flavour", json={"flavour": "4.6.0-4.8.3"})).status == 200
        current = await (await http.get("/metrics")).text()
        assert 'hostname="gpu-node-a"' in current
        assert "Hostname=" not in current

        assert (await http.put("/flavour", json={"flavour": "dcgm-4.7-bytes"})).status == 200
        in_bytes = await (await http.get("/metrics")).text()
        assert "DCGM_FI_DEV_FB_FREE{" not in in_bytes
        assert (
            f'DCGM_FI_DEV_FB_CAPACITY_BYTES{{gpu="0",UUID="{default_fleet().all_gpus()[0][1].uuid}"'
            in in_bytes
        )
        assert "} 42949672960" in in_bytes  # 40 960 MiB in bytes
        assert 'DCGM_FI_SYSTEM_DRIVER_VERSION="550.54.15"' in in_bytes

        assert (await http.put("/flavour", json={"flavour": "pod-hostname"})).status == 200
        pods = await (await http.get("/metrics")).text()
        assert 'Hostname="nvidia-dcgm-exporter-' in pods
        assert 'Hostname="gpu-node-a"' not in pods

        bad = await http.put("/flavour", json={"flavour": "9.9"})
        assert bad.status == 400
        assert "4.6.0-4.8.3" in (await bad.json())["error"]
    assert Fleet.load(path).exporter_flavour == "pod-hostname"  # kept across a restart
