"""Kaapana's Airflow pool kept in step with the GPU fleet (optional: VRAMSHARE_AIRFLOW_URL).

After every inventory poll the leader works out the pool's slots from the GPUs as judged
(`vramshare.domain.pools`) and sets them through Airflow's REST API when they changed, and again every
`airflow_pool_resync_s` in case someone edited the pool by hand. Airflow away is logged once, counted,
and retried at the next poll; its coming back is logged once too.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from vramshare.airflow_pools import AirflowPools, AirflowUnavailableError
from vramshare.controller.devices import InventoryLoop
from vramshare.controller.metrics import ControllerMetrics
from vramshare.controller.settings import ControllerSettings
from vramshare.domain.pools import pool_slots

log = structlog.get_logger("vramshare.controller")


class PoolSync:
    def __init__(
        self,
        *,
        settings: ControllerSettings,
        inventory: InventoryLoop,
        pools: AirflowPools,
        metrics: ControllerMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.inventory = inventory
        self.pools = pools
        self.metrics = metrics
        self.clock = clock
        self.written: int | None = None
        self.written_at = 0.0
        self.failing = False

    async def sync(self) -> None:
        """Set the pool's slots if they changed or are due to be asserted again."""
        s = self.settings
        slots = pool_slots(self.inventory.statuses, rule=s.airflow_pool_rule)
        if slots == self.written and self.clock() - self.written_at < s.airflow_pool_resync_s:
            return
        try:
            before = await self.pools.set_slots(
                pool=s.airflow_pool,
                slots=slots,
                description=f"GPU tasks; slots kept by vramshare ({s.airflow_pool_basis.value})",
            )
        except AirflowUnavailableError as exc:
            self.metrics.pool_sync_failures.inc()
            if not self.failing:
                log.warning(
                    "Airflow unreachable; pool slots not set, retried at every inventory poll",
                    pool=s.airflow_pool,
                    slots=slots,
                    error=str(exc),
                )
            self.failing = True
            return
        if self.failing:
            log.info("Airflow reachable again", pool=s.airflow_pool)
        self.failing = False
        if before != slots:
            log.info(
                "Airflow pool slots set", pool=s.airflow_pool, slots=slots, was=before, api=self.pools.api
            )
        self.written, self.written_at = slots, self.clock()
        self.metrics.pool_slots.labels(s.airflow_pool).set(slots)

    async def run(self) -> None:
        try:
            while True:
                await self.inventory.polled.wait()
                self.inventory.polled.clear()
                await self.sync()
        finally:
            await self.pools.close()
