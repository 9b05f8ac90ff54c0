"""The API server's clock, as this process estimates it from the `Date` header of the API server's
answers: ages of objects (their `creationTimestamp`, written by the API server) are measured on the
clock that wrote them, not on this machine's, which may be off by seconds or minutes (issue #30, 3).

`Date` has a resolution of one second (RFC 9110), so each answer bounds the server's time at its
arrival to [Date, Date + 1) seconds; the estimate is the middle of that, against the middle of the
request's round trip, and the offset is the median of the last answers' (a slow answer or a stale
header moves one sample, not the estimate). Error: about half a second plus half a round trip."""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from email.utils import parsedate_to_datetime

WINDOW = 31


class ServerClock:
    def __init__(self, *, local: Callable[[], float] = time.time) -> None:
        self.local = local
        self._offsets: deque[float] = deque(maxlen=WINDOW)
        self.offset_s = 0.0
        """The API server's clock minus this machine's (0 until an answer carried a Date)."""

    def observe(self, date: str | None, *, sent: float, received: float) -> None:
        """An answer's `Date` header, with this machine's times the request was sent and answered."""
        if not date:
            return
        try:
            server = parsedate_to_datetime(date).timestamp() + 0.5
        except (TypeError, ValueError, IndexError, OverflowError):
            return
        self._offsets.append(server - (sent + received) / 2)
        self.offset_s = statistics.median(self._offsets)

    def now(self) -> float:
        """The API server's time now, as far as this process can tell."""
        return self.local() + self.offset_s
