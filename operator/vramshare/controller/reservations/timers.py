"""Looks the reconciler takes later: at most one timer per booking and purpose, and the checks they
start, kept so that none is lost or left running on shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Hashable
from typing import Any


class KeyedTimers:
    """At most one pending call per key."""

    def __init__(self) -> None:
        self._handles: dict[Hashable, asyncio.TimerHandle] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self._handles

    def arm(self, key: Hashable, delay_s: float, due: Callable[[], None]) -> None:
        """Call `due` in `delay_s` seconds (the key is free again when it runs)."""

        def fire() -> None:
            self._handles.pop(key, None)
            due()

        self._handles[key] = asyncio.get_running_loop().call_later(delay_s, fire)

    def cancel(self, key: Hashable) -> None:
        handle = self._handles.pop(key, None)
        if handle is not None:
            handle.cancel()

    def cancel_all(self) -> None:
        for handle in self._handles.values():
            handle.cancel()
        self._handles.clear()


class Checks:
    """Checks started off the caller's path; a reference is kept until each ends."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, check: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(check)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
