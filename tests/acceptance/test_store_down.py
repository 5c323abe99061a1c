"""A store that does not answer never loses a delivery: it is deferred until the store is back."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from celery import Celery
from sqlalchemy import create_engine, func, select

from tests.acceptance.conftest import new_store_database, start_workers
from tests.apps import shop_tables
from tests.rig.procs import wait_until
from tests.rig.servers import PostgresServer, RedisServer

pytestmark = pytest.mark.workers


@pytest.fixture
def stoppable_postgres() -> Iterator[PostgresServer]:
    with PostgresServer() as server:  # its own server: this test stops and restarts it
        yield server


def test_a_delivery_waits_out_a_store_outage_and_then_runs_once(
    stoppable_postgres: PostgresServer, redis_server: RedisServer
) -> None:
    store_url = new_store_database(stoppable_postgres, "outage")
    env = {
        "CG_BROKER_URL": redis_server.url_for(5),
        "CG_RESULT_URL": redis_server.url_for(6),
        "CG_STORE_URL": store_url,
        "CG_STORE_TIMEOUT": "1",
    }
    client = Celery("outage-client", broker=env["CG_BROKER_URL"], backend=env["CG_RESULT_URL"])
    stoppable_postgres.stop(keep_data=True)
    (worker,) = start_workers(1, env)
    try:
        tag = uuid.uuid4().hex[:12]
        result = client.send_task("shop.record", args=(tag,))
        wait_until(lambda: result.state == "RETRY", timeout=30, what="the delivery to be deferred")
        assert "unavailable" in worker.log_text()
        stoppable_postgres.restart()
        assert result.get(timeout=60) == {"tag": tag, "value": None}
        engine = create_engine(store_url)
        try:
            with engine.connect() as connection:
                count = connection.execute(
                    select(func.count())
                    .select_from(shop_tables.effects)
                    .where(shop_tables.effects.c.tag == tag)
                ).scalar_one()
        finally:
            engine.dispose()
        assert count == 1
    finally:
        worker.stop()
        client.close()
