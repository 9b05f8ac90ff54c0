"""Setting an Airflow pool's slots through Airflow 3's REST API (aiohttp).

Airflow 3 authenticates API calls with a JWT: `POST /auth/token` with a username and password (the
simple auth manager and the FAB auth manager both serve it) returns `access_token`, sent as a bearer
token until it is refused (401 or 403), when a new one is fetched once. A pool that does not exist yet is
created.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp


class AirflowUnavailableError(Exception):
    """Airflow could not be reached, or refused the call; the message says which and why."""


@dataclass(frozen=True, kw_only=True)
class AirflowAccess:
    url: str
    """The API server's base URL, e.g. http://airflow-api-server.airflow.svc:8080."""
    username: str = ""
    password_file: str = ""
    """Read at every login, so a rotated password is picked up."""
    ca_file: str = ""
    """An https API server is verified against this CA bundle (default: the system's CAs)."""
    timeout_s: float = 5.0


class AirflowPools:
    def __init__(self, access: AirflowAccess) -> None:
        self.access = access
        self._token: str | None = None
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            ssl_context: ssl.SSLContext | bool = True
            if self.access.ca_file:
                ssl_context = ssl.create_default_context(cafile=self.access.ca_file)
            self._session = aiohttp.ClientSession(
                base_url=self.access.url.rstrip("/") + "/",
                timeout=aiohttp.ClientTimeout(total=self.access.timeout_s),
                connector=aiohttp.TCPConnector(ssl=ssl_context),
            )
        return self._session

    async def set_slots(self, *, pool: str, slots: int, description: str) -> int | None:
        """Give `pool` `slots`; returns the slots it had, or None when it was created."""
        path = f"api/v2/pools/{quote(pool, safe='')}"
        status, body = await self._call("GET", path)
        if status == 404:
            await self._expect(
                "POST", "api/v2/pools", {201}, json={"name": pool, "slots": slots, "description": description}
            )
            return None
        if status != 200:
            raise AirflowUnavailableError(f"GET /{path} answered {status}: {_short(body)}")
        current = body if isinstance(body, dict) else {}
        before = int(current["slots"]) if "slots" in current else None
        if before != slots:
            # The mask changes only the slots, but Airflow 3 validates a whole pool in the body.
            whole = {"name": pool, "slots": slots, "include_deferred": bool(current.get("include_deferred"))}
            await self._expect("PATCH", path, {200}, params={"update_mask": "slots"}, json=whole)
        return before

    async def _expect(self, method: str, path: str, ok: set[int], **kwargs: Any) -> Any:
        status, body = await self._call(method, path, **kwargs)
        if status not in ok:
            raise AirflowUnavailableError(f"{method} /{path} answered {status}: {_short(body)}")
        return body

    async def _call(self, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
        """One call with the current token; a refusal (401, or 403 for an expired or foreign token in
        Airflow 3) fetches a new token and tries once more."""
        for attempt in range(2):
            if self._token is None:
                self._token = await self._login()
            headers = {"Authorization": f"Bearer {self._token}"}
            status, body = await self._request(method, path, headers=headers, **kwargs)
            if status not in (401, 403) or attempt:
                return status, body
            self._token = None
        raise AssertionError("unreachable")

    async def _login(self) -> str:
        password = ""
        if self.access.password_file:
            try:
                password = (await asyncio.to_thread(Path(self.access.password_file).read_text)).strip()
            except OSError as exc:
                raise AirflowUnavailableError(f"cannot read the Airflow password file: {exc}") from exc
        status, body = await self._request(
            "POST", "auth/token", json={"username": self.access.username, "password": password}
        )
        token = body.get("access_token") if isinstance(body, dict) else None
        if status not in (200, 201) or not isinstance(token, str):
            raise AirflowUnavailableError(
                f"logging in to Airflow as {self.access.username!r} answered {status}: {_short(body)}"
            )
        return token

    async def _request(self, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
        try:
            async with self._client().request(method, path, **kwargs) as resp:
                text = await resp.text()
                try:
                    return resp.status, await resp.json(content_type=None) if text else None
                except ValueError:
                    return resp.status, text
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise AirflowUnavailableError(
                f"{self.access.url}: {type(exc).__name__}: {exc or 'timed out'}"
            ) from exc


def _short(body: Any) -> str:
    text = body.get("detail", body) if isinstance(body, dict) else body
    return str(text)[:300]
