"""The pool sync's Airflow client against a real Airflow 2 (2.11, its webserver's REST API v1 with
basic auth): Kaapana's releases run Airflow 2. Airflow 3 is exercised through the controller in
test_airflow_e2e.py; the client finds which one answers at its first login."""

from __future__ import annotations

import base64
import itertools
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from vramshare.airflow_pools import AIRFLOW_2, AirflowAccess, AirflowPools, AirflowUnavailableError
from vramshare_e2e.airflow import PASSWORD, USER, VIEWER, airflow2_webserver
from vramshare_e2e.cluster import LocalCluster
from vramshare_e2e.components import start_controller
from vramshare_e2e.process import eventually

POOL = "NODE_GPU_COUNT"


@pytest.fixture(scope="module")
def airflow2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with airflow2_webserver(tmp_path_factory.mktemp("airflow2")) as url:
        yield url


def rest(url: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """Airflow 2's REST API v1 as the admin user, straight (not through vramshare's client)."""
    auth = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    request = urllib.request.Request(
        f"{url}/api/v1/{path}",
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization": f"Basic {auth}", "Content-Type": "application/json"},
        method=method,
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.loads(resp.read())


@pytest.fixture
async def client(airflow2: str, tmp_path: Path) -> AsyncIterator[tuple[AirflowPools, Path]]:
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD + "\n")
    pools = AirflowPools(AirflowAccess(url=airflow2, username=USER, password_file=str(password_file)))
    yield pools, password_file
    await pools.close()


async def test_the_pool_is_created_set_and_set_back_after_a_hand_edit(
    airflow2: str, client: tuple[AirflowPools, Path]
) -> None:
    pools, _ = client
    assert await pools.set_slots(pool=POOL, slots=5, description="GPU tasks") is None  # created
    assert pools.api == AIRFLOW_2
    created = rest(airflow2, "GET", f"pools/{POOL}")
    assert (created["slots"], created["description"]) == (5, "GPU tasks")

    assert await pools.set_slots(pool=POOL, slots=4, description="GPU tasks") == 5
    assert rest(airflow2, "GET", f"pools/{POOL}")["slots"] == 4

    rest(airflow2, "PATCH", f"pools/{POOL}?update_mask=slots", {"name": POOL, "slots": 9})  # by hand
    assert await pools.set_slots(pool=POOL, slots=4, description="GPU tasks") == 9
    assert rest(airflow2, "GET", f"pools/{POOL}")["slots"] == 4


async def test_a_wrong_password_is_explained_and_a_rotated_one_is_read_without_a_restart(
    airflow2: str, client: tuple[AirflowPools, Path]
) -> None:
    pools, password_file = client
    password_file.write_text("not-the-password")
    with pytest.raises(AirflowUnavailableError) as refused:
        await pools.set_slots(pool="rotation", slots=3, description="GPU tasks")
    message = str(refused.value)
    assert f"Airflow 2 refused user {USER!r} (401) on /api/v1/pools/rotation" in message
    assert "airflow.api.auth.backend.basic_auth" in message

    password_file.write_text(PASSWORD)  # the Secret is updated; the same client logs in again
    assert await pools.set_slots(pool="rotation", slots=3, description="GPU tasks") is None
    assert rest(airflow2, "GET", "pools/rotation")["slots"] == 3


async def test_a_user_who_may_not_edit_pools_is_told_which_role_can(airflow2: str, tmp_path: Path) -> None:
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD)
    pools = AirflowPools(AirflowAccess(url=airflow2, username=VIEWER, password_file=str(password_file)))
    try:
        with pytest.raises(AirflowUnavailableError) as refused:
            await pools.set_slots(pool="viewer-pool", slots=2, description="GPU tasks")
    finally:
        await pools.close()
    assert f"Airflow user {VIEWER!r} may not" in str(refused.value)
    assert "(403): give it a role that can read and edit pools (Op or Admin)" in str(refused.value)


@pytest.mark.cluster
def test_the_controller_keeps_an_airflow_2_pool_at_the_ready_gpus(airflow2: str, tmp_path: Path) -> None:
    """The whole path: the controller on a local control plane, its pool sync against Airflow 2."""
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD)
    with LocalCluster.start() as cluster:
        start_controller(
            cluster,
            name="controller",
            env={
                "VRAMSHARE_POLL_INTERVAL_S": "1",
                "VRAMSHARE_AIRFLOW_URL": airflow2,
                "VRAMSHARE_AIRFLOW_USERNAME": USER,
                "VRAMSHARE_AIRFLOW_PASSWORD_FILE": str(password_file),
                "VRAMSHARE_AIRFLOW_POOL": "kaapana-gpus",
            },
        )
        gpus = len(cluster.settings.fleet.all_gpus())

        def slots() -> int | None:
            try:
                return int(rest(airflow2, "GET", "pools/kaapana-gpus")["slots"])
            except urllib.error.HTTPError:
                return None

        eventually(lambda: slots() == gpus, what=f"the pool created with {gpus} slots", timeout_s=60)
        log = cluster.component("controller").log_path.read_text().splitlines()
        # Created once, then followed: a first poll that saw only some GPUs ready sets fewer slots
        # (seen on a loaded machine), and the next one raises them.
        lines = [json.loads(x) for x in log if "Airflow pool slots set" in x]
        assert lines, log
        assert lines[0]["was"] is None
        assert (lines[-1]["slots"], lines[-1]["api"]) == (gpus, AIRFLOW_2)
        for before, after in itertools.pairwise(lines):
            assert after["was"] == before["slots"] < gpus
