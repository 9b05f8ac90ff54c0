"""The pool client's handling of an Airflow older than any the integration tests install: Airflow 2.6
(no `include_deferred` on pools, unknown fields refused), served by a stand-in on aiohttp's in-process
server. Airflow 3.3 and 2.11 themselves are in tests/integration."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from vramshare.airflow_pools import AIRFLOW_2, AirflowAccess, AirflowPools


def airflow_2_6(patches: list[dict[str, Any]]) -> web.Application:
    pool = {"name": "gpus", "slots": 3, "description": ""}

    async def no_token_login(_: web.Request) -> web.Response:
        return web.json_response({"detail": "Not Found"}, status=404)

    async def get_pool(_: web.Request) -> web.Response:
        return web.json_response(pool)

    async def patch_pool(request: web.Request) -> web.Response:
        body = await request.json()
        patches.append(body)
        unknown = set(body) - {"name", "slots", "description"}
        if unknown:  # as marshmallow does in Airflow 2.6
            return web.json_response({"detail": f"{{'{unknown.pop()}': ['Unknown field.']}}"}, status=400)
        pool["slots"] = body["slots"]
        return web.json_response(pool)

    app = web.Application()
    app.router.add_post("/auth/token", no_token_login)
    app.router.add_get("/api/v1/pools/gpus", get_pool)
    app.router.add_patch("/api/v1/pools/gpus", patch_pool)
    return app


async def test_a_pool_without_include_deferred_is_patched_without_it() -> None:
    patches: list[dict[str, Any]] = []
    async with TestServer(airflow_2_6(patches)) as server:
        pools = AirflowPools(AirflowAccess(url=str(server.make_url("/")), username="vramshare"))
        try:
            assert await pools.set_slots(pool="gpus", slots=5, description="") == 3
        finally:
            await pools.close()
    assert pools.api == AIRFLOW_2
    assert patches == [{"name": "gpus", "slots": 5}]
