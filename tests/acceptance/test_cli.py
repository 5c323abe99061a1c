"""``celery -A app guard migrate`` as an operator runs it: a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

from sqlalchemy import create_engine, inspect

from tests.acceptance.conftest import ROOT, SHOP_APP
from tests.rig.servers import PostgresServer, RedisServer


def run_guard(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", SHOP_APP, "guard", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_migrate_creates_the_tables_and_can_run_again(
    postgres: PostgresServer, redis_server: RedisServer
) -> None:
    url = postgres.create_database("cli_migrate")
    env = {"CG_STORE_URL": url, "CG_BROKER_URL": redis_server.url_for(7)}
    for _ in range(2):
        completed = run_guard("migrate", env=env)
        assert completed.returncode == 0, completed.stderr
        assert "celery_guard tables are ready" in completed.stdout
    engine = create_engine(url)
    try:
        assert "celery_guard_keys" in inspect(engine).get_table_names()
    finally:
        engine.dispose()


def test_migrate_against_an_unreachable_store_exits_non_zero_with_one_line(
    redis_server: RedisServer,
) -> None:
    env = {
        "CG_STORE_URL": "postgresql://shop:s3cret@127.0.0.1:9/shop",
        "CG_STORE_TIMEOUT": "1",
        "CG_BROKER_URL": redis_server.url_for(7),
    }
    completed = run_guard("migrate", env=env)
    assert completed.returncode != 0
    assert "unavailable" in completed.stderr
    assert "s3cret" not in completed.stderr + completed.stdout
