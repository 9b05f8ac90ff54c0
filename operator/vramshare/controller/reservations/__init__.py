"""The reservation reconciler: each GpuReservation kept in step with its pod.

- `plan`: the lifecycle's plan for one booking (pure): the status to write, the event, a deletion;
- `wording`: the events users see, worded from the booking;
- `timers`: the looks taken later (a booking's TTL, a binding that waits for its pod to run);
- `pins`: which pod each booking is bound to, kept in memory;
- `notices`: the events said once (an impostor pod, a deletion that waits, a pod stuck unschedulable);
- `reconciler`: `ReservationReconciler`, which applies plans on sweeps and pod events.
"""

from vramshare.controller.reservations.plan import Plan, plan, pod_sighting
from vramshare.controller.reservations.reconciler import ReservationReconciler

__all__ = ["Plan", "ReservationReconciler", "plan", "pod_sighting"]
