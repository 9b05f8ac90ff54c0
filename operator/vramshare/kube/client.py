"""A thin asynchronous Kubernetes REST client on aiohttp.

The official `kubernetes` package is used only to read the kubeconfig or the in-cluster service
account; requests go through one shared aiohttp session so nothing blocks the event loop (the webhook
sits in the pod-creation path). Objects are plain dicts, exactly as the API server sends them.
"""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Self
from urllib.parse import urlencode

import aiohttp
from kubernetes import config as kube_config
from kubernetes.client import Configuration

from vramshare.kube.server_clock import ServerClock

Obj = dict[str, Any]

SERVICE_ACCOUNT_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
_TOKEN_REREAD_S = 60.0  # projected service-account tokens rotate; re-read the file this often


class ApiError(Exception):
    """A non-2xx answer from the API server."""

    def __init__(self, *, status: int, reason: str, message: str, body: Obj | None = None) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.body = body or {}

    @property
    def conflict(self) -> bool:
        return self.status == 409

    @property
    def not_found(self) -> bool:
        return self.status == 404


@dataclass(frozen=True, kw_only=True)
class Connection:
    """Where the API server is and how to authenticate to it."""

    host: str
    ssl_context: ssl.SSLContext
    token: str | None = None
    token_file: Path | None = None

    @classmethod
    def load(cls, *, kubeconfig: str | None = None, context: str | None = None) -> Self:
        """From a kubeconfig file, else the in-cluster service account, else ~/.kube/config (or
        $KUBECONFIG); `context` picks one of the kubeconfig's contexts."""
        configuration = Configuration()
        if kubeconfig or context:
            kube_config.load_kube_config(
                config_file=kubeconfig or None, context=context, client_configuration=configuration
            )
            return cls.from_configuration(configuration)
        try:
            kube_config.load_incluster_config(client_configuration=configuration)
        except kube_config.ConfigException:
            kube_config.load_kube_config(client_configuration=configuration)
            return cls.from_configuration(configuration)
        return cls.from_configuration(configuration, token_file=SERVICE_ACCOUNT_TOKEN)

    @classmethod
    def from_configuration(cls, configuration: Configuration, *, token_file: Path | None = None) -> Self:
        """From a kubernetes client Configuration as its config loaders fill it in; `token_file`: the
        in-cluster token's file, re-read as it rotates."""
        tls = ssl.create_default_context(cafile=configuration.ssl_ca_cert)
        if configuration.cert_file:
            tls.load_cert_chain(configuration.cert_file, configuration.key_file)
        if not configuration.verify_ssl:
            tls.check_hostname = False
            tls.verify_mode = ssl.CERT_NONE
        # The key is "BearerToken" in current kubernetes clients and "authorization" in older ones;
        # the scheme is "Bearer" from a kubeconfig but "bearer" in cluster (kubernetes 37's
        # incluster_config.py): matched without case, or every in-cluster request goes anonymous.
        raw = configuration.api_key.get("BearerToken") or configuration.api_key.get("authorization") or ""
        scheme, _, value = raw.strip().partition(" ")
        token = value.strip() if scheme.lower() == "bearer" and value.strip() else None
        return cls(host=configuration.host.rstrip("/"), ssl_context=tls, token=token, token_file=token_file)


class KubeClient:
    """Generic CRUD on API paths. Create with `async with KubeClient(connection) as kube:`."""

    def __init__(
        self, connection: Connection, *, timeout_s: float = 10.0, user_agent: str = "vramshare"
    ) -> None:
        self.connection = connection
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._user_agent = user_agent
        self._session: aiohttp.ClientSession | None = None
        self._token = connection.token
        self._token_read_at = time.monotonic()
        self.server_clock = ServerClock()
        """The API server's clock, estimated from its answers' Date header: ages of objects the API
        server stamped (creationTimestamp) are measured on it."""

    async def __aenter__(self) -> Self:
        connector = aiohttp.TCPConnector(ssl=self.connection.ssl_context, limit=64)
        # Watch streams are read line by line; a large buffer keeps a big object's line in one piece.
        self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout, read_bufsize=2**20)
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": self._user_agent}
        if content_type:
            headers["Content-Type"] = content_type
        file = self.connection.token_file
        if file is not None and time.monotonic() - self._token_read_at > _TOKEN_REREAD_S:
            self._token = file.read_text().strip()
            self._token_read_at = time.monotonic()
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        return headers

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Obj:
        if self._session is None:
            raise RuntimeError("KubeClient used outside 'async with'")
        url = f"{self.connection.host}{path}"
        if params:
            url += "?" + urlencode(params)
        data = None if body is None else json.dumps(body, separators=(",", ":"))
        sent = time.time()
        async with self._session.request(
            method, url, data=data, headers=self._headers(content_type if data else None)
        ) as resp:
            self.server_clock.observe(resp.headers.get("Date"), sent=sent, received=time.time())
            text = await resp.text()
            try:
                payload: Obj = json.loads(text) if text else {}
            except ValueError:
                payload = {"message": text}
            if resp.status >= 400:
                raise ApiError(
                    status=resp.status,
                    reason=str(payload.get("reason", resp.reason)),
                    message=str(payload.get("message", text))[:2000],
                    body=payload,
                )
            return payload

    async def get(self, path: str, *, resource_version: str | None = None) -> Obj:
        """GET. `resource_version="0"` is served from the API server's watch cache, as it is: no read
        of etcd, and possibly a moment behind it."""
        params = {"resourceVersion": resource_version} if resource_version is not None else None
        return await self.request("GET", path, params=params)

    async def list(
        self,
        path: str,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        resource_version: str | None = None,
        not_older_than: bool = False,
        limit: int | None = None,
        continue_token: str | None = None,
    ) -> Obj:
        """LIST. `resource_version="0"` reads the API server's cache as it is (no wait for freshness);
        with `not_older_than`, a cache at least as new as `resource_version`. `limit` and
        `continue_token` page through a large collection."""
        params = {}
        if label_selector:
            params["labelSelector"] = label_selector
        if field_selector:
            params["fieldSelector"] = field_selector
        if limit:
            params["limit"] = str(limit)
        if continue_token:
            params["continue"] = continue_token
        if resource_version is not None:
            params["resourceVersion"] = resource_version
            if not_older_than:
                params["resourceVersionMatch"] = "NotOlderThan"
        return await self.request("GET", path, params=params or None)

    async def watch(
        self,
        path: str,
        *,
        resource_version: str,
        label_selector: str | None = None,
        field_selector: str | None = None,
        timeout_s: int = 300,
    ) -> AsyncIterator[Obj]:
        """WATCH from `resource_version`, with bookmarks: yields each event ({"type", "object"}) until
        the server ends the stream (after about `timeout_s`). A 410 Gone arrives as an ERROR event."""
        if self._session is None:
            raise RuntimeError("KubeClient used outside 'async with'")
        params = {
            "watch": "1",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_s),
        }
        if label_selector:
            params["labelSelector"] = label_selector
        if field_selector:
            params["fieldSelector"] = field_selector
        url = f"{self.connection.host}{path}?{urlencode(params)}"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=timeout_s + 30)
        try:
            async with self._session.get(url, headers=self._headers(), timeout=timeout) as resp:
                if resp.status >= 400:
                    text = await resp.text()
                    raise ApiError(status=resp.status, reason=resp.reason or "", message=text[:2000])
                async for line in resp.content:
                    if line.strip():
                        yield json.loads(line)
        except aiohttp.ClientError as exc:  # the stream broke (the API server went away, a proxy cut it)
            raise ConnectionError(f"watch of {path} broke: {exc!r}") from exc

    async def create(self, path: str, obj: Obj, *, dry_run: bool = False) -> Obj:
        return await self.request("POST", path, body=obj, params={"dryRun": "All"} if dry_run else None)

    async def replace(self, path: str, obj: Obj) -> Obj:
        """PUT: fails with 409 when obj's metadata.resourceVersion is no longer current."""
        return await self.request("PUT", path, body=obj)

    async def json_patch(self, path: str, operations: Sequence[Obj]) -> Obj:
        return await self.request("PATCH", path, body=operations, content_type="application/json-patch+json")

    async def merge_patch(self, path: str, patch: Obj) -> Obj:
        return await self.request("PATCH", path, body=patch, content_type="application/merge-patch+json")

    async def delete(self, path: str, *, resource_version: str | None = None) -> Obj:
        body = {"preconditions": {"resourceVersion": resource_version}} if resource_version else None
        return await self.request("DELETE", path, body=body)


class Lister(Protocol):
    async def list(
        self,
        path: str,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        resource_version: str | None = None,
        not_older_than: bool = False,
        limit: int | None = None,
        continue_token: str | None = None,
    ) -> Obj: ...


async def list_all(
    kube: Lister,
    path: str,
    *,
    label_selector: str | None = None,
    resource_version: str | None = None,
    not_older_than: bool = False,
    page: int = 500,
) -> Obj:
    """LIST in pages of `page` items (the pages after the first are served at the first one's
    resourceVersion, so together they are one consistent read), merged into one list. No single answer
    grows with the collection, for the API server or for us."""
    items: list[Obj] = []
    token: str | None = None
    first: Obj | None = None
    while True:
        answer = await kube.list(
            path,
            label_selector=label_selector,
            resource_version=None if token else resource_version,
            not_older_than=not_older_than and not token,
            limit=page,
            continue_token=token,
        )
        first = first or answer
        items += answer.get("items") or []
        token = (answer.get("metadata") or {}).get("continue")
        if not token:
            break
    return {**first, "items": items, "metadata": {**(first.get("metadata") or {}), "continue": None}}
