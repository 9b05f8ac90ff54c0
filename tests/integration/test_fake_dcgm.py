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
