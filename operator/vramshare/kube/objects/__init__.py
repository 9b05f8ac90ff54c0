"""GpuDevice and GpuReservation as typed values, with their one conversion from and to the wire.

Every reader of vramshare's custom resources (the webhook's ledger, the controller, `vramshare status`)
decodes them here, so a field's spelling and its default live in one place. Times are Unix seconds.
Decoding is lenient where the API server's schema already guarantees a shape, and defaults what an
older object may lack (a reservation without status is Reserved: the webhook cannot write status on
create).

- `meta`: the metadata every object carries;
- `reservation`: GpuReservation;
- `device`: GpuDevice.
"""

from vramshare.kube.objects.device import Condition, Delivery, DeviceSpec, DeviceStatus, GpuDevice
from vramshare.kube.objects.meta import Meta, Obj, OwnerRef, remove_finalizer
from vramshare.kube.objects.reservation import GpuReservation, ReservationSpec, ReservationStatus

__all__ = [
    "Condition",
    "Delivery",
    "DeviceSpec",
    "DeviceStatus",
    "GpuDevice",
    "GpuReservation",
    "Meta",
    "Obj",
    "OwnerRef",
    "ReservationSpec",
    "ReservationStatus",
    "remove_finalizer",
]
