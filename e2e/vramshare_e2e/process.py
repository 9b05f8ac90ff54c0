"""Process supervision for the local stack: a `Component` is one process, started in its own process
group with its log in a file, stopped with its children, and judged ready by a check; `eventually`
waits for a condition."""

from __future__ import annotations

import contextlib
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar


class ClusterError(RuntimeError):
    """The local control plane could not be started or used; the message carries the logs' tails."""


def say(message: str) -> None:
    print(f"[vramshare cluster] {message}", file=sys.stderr, flush=True)


T = TypeVar("T")


def eventually(
    check: Callable[[], T],
    *,
    what: str,
    timeout_s: float = 30.0,
    interval_s: float = 0.25,
    detail: Callable[[], object] | None = None,
) -> T:
    """Poll `check` until it returns something truthy, and return that; AssertionError on timeout, with
    what `detail` returns then (the state that was not reached, for the failure's reader)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            seen = f"; last seen: {detail()}" if detail is not None else ""
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}{seen}")
        time.sleep(interval_s)


@dataclass
class Component:
    """One process of the stack: how to start it and how to tell it is ready."""

    name: str
    argv: list[str]
    log_path: Path
    ready: Callable[[], bool]
    env: dict[str, str] | None = None
    process: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        log = self.log_path.open("ab")
        log.write(f"\n=== start {time.strftime('%H:%M:%S')}: {' '.join(self.argv)}\n".encode())
        log.flush()
        self.process = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stopping it stops its children too
            env=self.env,
        )
        log.close()

    def stop(self, *, timeout_s: float = 10.0, kill: bool = False) -> None:
        proc = self.process
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=timeout_s)
        # Reap stragglers in its group (a process that forked and exited first).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        self.process = None

    def wait_ready(self, *, timeout_s: float) -> None:
        """Until it is ready; ClusterError with its log's tail if it exits or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready():
                return
            if not self.running:
                raise ClusterError(f"{self.name} exited while starting; last log lines:\n{self.tail()}")
            time.sleep(0.2)
        raise ClusterError(
            f"{self.name} was not ready within {timeout_s:g} s; last log lines:\n{self.tail()}"
        )

    def tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text[-lines:])


def http_ok(url: str, *, context: ssl.SSLContext | None = None, expect: str | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as resp:
            body = resp.read().decode(errors="replace")
            return resp.status == 200 and (expect is None or expect in body)
    except (urllib.error.URLError, ConnectionError, TimeoutError, ssl.SSLError, OSError):
        return False


def wait_for_signal() -> None:
    """Block until Ctrl-C or SIGTERM (a demo kept up with KEEP=1)."""
    stop = {"now": False}

    def on_signal(*_: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    while not stop["now"]:
        time.sleep(0.5)
