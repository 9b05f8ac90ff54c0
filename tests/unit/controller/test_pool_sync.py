"""The Airflow pool sync's decisions (when to write, what to log) against a stand-in for Airflow;
the real API server is in tests/integration/test_airflow_e2e.py."""

from __future__ import annotations

from typing import Any

import pytest
from structlog.testing import capture_logs

from tests.unit.domain.builders import judged
from vramshare.airflow_pools import AirflowUnavailableError
from vramshare.controller.metrics import ControllerMetrics
from vramshare.controller.pools import PoolSync
from vramshare.controller.settings import ControllerSettings
from vramshare.domain.inventory import DeviceState
from vramshare.settings import SettingsError


class Pools:
    def __init__(self) -> None:
        self.slots: int | None = None
        self.calls = 0
        self.down = False
        self.api = "Airflow 3 (REST API v2, token login)"

    async def set_slots(self, *, pool: str, slots: int, description: str) -> int | None:
        self.calls += 1
        if self.down:
            raise AirflowUnavailableError("http://airflow.test: ClientConnectorError")
        before, self.slots = self.slots, slots
        return before

    async def close(self) -> None:
        pass


class Inventory:
    def __init__(self, *states: DeviceState) -> None:
        self.statuses = [judged(s, uuid=f"GPU-{i}") for i, s in enumerate(states)]


def sync_of(inventory: Inventory, pools: Pools, clock: list[float], **settings: Any) -> PoolSync:
    return PoolSync(
        settings=ControllerSettings(airflow_url="http://airflow.test", **settings),
        inventory=inventory,  # type: ignore[arg-type]
        pools=pools,  # type: ignore[arg-type]
        metrics=ControllerMetrics(),
        clock=lambda: clock[0],
    )


async def test_slots_are_written_on_change_and_asserted_again_after_the_resync_interval() -> None:
    inventory, pools, clock = Inventory(DeviceState.READY, DeviceState.READY), Pools(), [0.0]
    sync = sync_of(inventory, pools, clock, airflow_pool_resync_s=60)
    await sync.sync()
    assert (pools.slots, pools.calls) == (2, 1)
    await sync.sync()
    assert pools.calls == 1  # unchanged and not due
    inventory.statuses[1] = judged(DeviceState.MISSING, uuid="GPU-1")
    await sync.sync()
    assert (pools.slots, pools.calls) == (1, 2)
    clock[0] = 61
    await sync.sync()
    assert pools.calls == 3
    assert sync.metrics.pool_slots.labels("NODE_GPU_COUNT")._value.get() == 1


async def test_airflow_away_is_logged_once_and_retried_at_every_poll() -> None:
    inventory, pools, clock = Inventory(DeviceState.READY), Pools(), [0.0]
    sync = sync_of(inventory, pools, clock)
    pools.down = True
    with capture_logs() as logs:
        for _ in range(3):
            await sync.sync()
        pools.down = False
        await sync.sync()
    assert pools.calls == 4
    assert [e["event"] for e in logs] == [
        "Airflow unreachable; pool slots not set, retried at every inventory poll",
        "Airflow reachable again",
        "Airflow pool slots set",
    ]
    assert sync.metrics.pool_sync_failures._value.get() == 3
    assert pools.slots == 1


@pytest.mark.parametrize(
    ("env", "problem"),
    [
        ({"VRAMSHARE_AIRFLOW_URL": "airflow:8080"}, "VRAMSHARE_AIRFLOW_URL='airflow:8080' is not valid"),
        ({"VRAMSHARE_AIRFLOW_POOL_BASIS": "gpus"}, "VRAMSHARE_AIRFLOW_POOL_BASIS='gpus' is not valid"),
        ({"VRAMSHARE_AIRFLOW_POOL_TASK_MIB": "0"}, "VRAMSHARE_AIRFLOW_POOL_TASK_MIB=0 is not valid"),
        # Not only the pool's: a typo in the log level is an error, not a silent "info".
        (
            {"VRAMSHARE_LOG_LEVEL": "verbose"},
            "VRAMSHARE_LOG_LEVEL='verbose' is not valid: expected debug, info",
        ),
        ({"VRAMSHARE_MEMORY_RESOURCE": "a/b/c"}, "VRAMSHARE_MEMORY_RESOURCE='a/b/c' is not valid"),
    ],
)
def test_pool_settings_are_checked(env: dict[str, str], problem: str) -> None:
    with pytest.raises(SettingsError, match=problem):
        ControllerSettings.from_env(env)
