"""Setting an Airflow pool's slots through Airflow's REST API (aiohttp): Airflow 3 or Airflow 2.

Airflow 3 authenticates API calls with a JWT: `POST /auth/token` with a username and password (the
simple auth manager and the FAB auth manager both serve it) returns `access_token`, sent as a bearer
token until it is refused (401 or 403), when a new one is fetched once. Airflow 2 has no `/auth/token`
(404): its stable REST API, `/api/v1`, takes the same username and password as HTTP basic auth, which
its `[api] auth_backends` must allow (`airflow.api.auth.backend.basic_auth`). Which one answers is found
at the first login. A pool that does not exist yet is created.
"""

from __future__ import annotations

import asyncio
import base64
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


AIRFLOW_3 = "Airflow 3 (REST API v2, token login)"
AIRFLOW_2 = "Airflow 2 (REST API v1, basic auth)"


class AirflowPools:
    def __init__(self, access: AirflowAccess) -> None:
        self.access = access
        self.api: str | None = None
        """AIRFLOW_3 or AIRFLOW_2 once a login has found out; None before."""
        self._token: str | None = None
        self._basic: str | None = None
        """The Authorization header for Airflow 2's basic auth."""
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
        if self.api is None:
            await self._login()
        pools = "api/v2/pools" if self.api == AIRFLOW_3 else "api/v1/pools"
        path = f"{pools}/{quote(pool, safe='')}"
        status, body = await self._call("GET", path)
        if status == 404:
            created = {200, 201}  # Airflow 3 answers 201, Airflow 2 200
            await self._expect(
                "POST", pools, created, json={"name": pool, "slots": slots, "description": description}
            )
            return None
        if status != 200:
            raise AirflowUnavailableError(f"GET /{path} answered {status}: {_short(body)}")
        current = body if isinstance(body, dict) else {}
        before = int(current["slots"]) if "slots" in current else None
        if before != slots:
            # The mask changes only the slots, but Airflow validates a whole pool in the body. Airflow
            # before 2.7 has no include_deferred and refuses unknown fields, so it is sent back only
            # where the pool has it.
            whole: dict[str, Any] = {"name": pool, "slots": slots}
            if "include_deferred" in current:
                whole["include_deferred"] = bool(current["include_deferred"])
            await self._expect("PATCH", path, {200}, params={"update_mask": "slots"}, json=whole)
        return before

    async def _expect(self, method: str, path: str, ok: set[int], **kwargs: Any) -> Any:
        status, body = await self._call(method, path, **kwargs)
        if status not in ok:
            raise AirflowUnavailableError(f"{method} /{path} answered {status}: {_short(body)}")
        return body

    async def _call(self, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
        """One call with the current credentials; a refusal (401, or 403 for an expired or foreign
        token in Airflow 3) logs in again (a new token, or the password read again) and tries once
        more."""
        for attempt in range(2):
            if self._token is None and self._basic is None:
                await self._login()
            status, body = await self._request(method, path, **self._credentials(), **kwargs)
            if status not in (401, 403) or attempt:
                if status == 401 and self.api == AIRFLOW_2:
                    raise AirflowUnavailableError(
                        f"Airflow 2 refused user {self.access.username!r} (401) on /{path}: the password "
                        "must match, and [api] auth_backends must include "
                        "airflow.api.auth.backend.basic_auth (Airflow 2's default allows the UI's session "
                        "only)"
                    )
                if status == 403:
                    raise AirflowUnavailableError(
                        f"Airflow user {self.access.username!r} may not {method} /{path} (403): give it a "
                        f"role that can read and edit pools (Op or Admin); {_short(body)}"
                    )
                return status, body
            self._token = self._basic = None
        raise AssertionError("unreachable")

    def _credentials(self) -> dict[str, Any]:
        return {"headers": {"Authorization": self._basic or f"Bearer {self._token}"}}

    async def _login(self) -> None:
        """A token from Airflow 3's /auth/token; where that is missing (Airflow 2), basic auth."""
        password = ""
        if self.access.password_file:
            try:
                password = (await asyncio.to_thread(Path(self.access.password_file).read_text)).strip()
            except OSError as exc:
                raise AirflowUnavailableError(f"cannot read the Airflow password file: {exc}") from exc
        status, body = await self._request(
            "POST", "auth/token", json={"username": self.access.username, "password": password}
        )
        if status in (404, 405):
            self.api = AIRFLOW_2
            pair = f"{self.access.username}:{password}".encode()
            self._basic = "Basic " + base64.b64encode(pair).decode()
            return
        token = body.get("access_token") if isinstance(body, dict) else None
        if status not in (200, 201) or not isinstance(token, str):
            raise AirflowUnavailableError(
                f"logging in to Airflow as {self.access.username!r} answered {status}: {_short(body)}"
            )
        self.api = AIRFLOW_3
        self._token = token

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
