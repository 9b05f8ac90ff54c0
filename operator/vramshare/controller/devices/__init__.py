"""The inventory: GpuDevices kept in step with DCGM.

- `loop`: `InventoryLoop`, one poll after another;
- `status`: what a GpuDevice's status says about a judged GPU (pure);
- `write_policy`: when a status is written (pure);
- `writer`: the GpuDevice writes and their events;
- `reporting`: metrics and log lines of a poll.
"""

from vramshare.controller.devices.loop import InventoryLoop
from vramshare.controller.devices.status import conditions, device_status
from vramshare.controller.devices.write_policy import refresh_after, refresh_budget

__all__ = ["InventoryLoop", "conditions", "device_status", "refresh_after", "refresh_budget"]
