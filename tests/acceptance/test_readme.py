"""The README's Quick start, run as a reader would: its code blocks, as written, on real servers.

The blocks are found by the ``<!-- quickstart: NAME -->`` comment before each one in README.md.
``tasks.py`` and ``call.py`` are written to a fresh directory unchanged; the worker command is
run as written (a real ``celery worker``, stopped by PID); ``python call.py`` must print exactly
the block the README says you see. Only the servers differ: the README's code reads its URLs
from ``SHOP_BROKER_URL``, ``SHOP_RESULT_URL`` and ``SHOP_STORE_URL``, which the test points at
the rig's Redis and PostgreSQL (or a SQLite file), as the README tells a reader to.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import re
import shlex
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from sqlalchemy import text

import celery_guard
from celery_guard import GuardConfig
from celery_guard.config import CONFIG_PREFIX
from celery_guard.keys import HEADER_KEY, HEADER_KEY_SOURCE
from celery_guard.messages import PUBLISHED_AT_HEADER
from celery_guard.store import SqlStore
from tests.acceptance.conftest import ROOT
from tests.rig.servers import PostgresServer, RedisServer
from tests.rig.workers import WorkerProcess

pytestmark = pytest.mark.workers

README = ROOT / "README.md"
QUICKSTART = ("install", "tasks.py", "worker", "call.py", "output")
# A Redis database no other test uses: the README's worker consumes Celery's default queue.
REDIS_DB = 15

_BLOCK = re.compile(
    r"<!-- quickstart: (?P<name>\S+) -->\n```[\w-]*\n(?P<body>.*?)^```$", re.M | re.S
)


def quickstart_blocks(readme: str) -> dict[str, str]:
    """The Quick start's marked code blocks by name; each name exactly once."""
    blocks: dict[str, str] = {}
    for match in _BLOCK.finditer(readme):
        name = match["name"]
        assert name not in blocks, f"README.md marks two blocks as quickstart: {name}"
        blocks[name] = match["body"]
    assert set(blocks) == set(QUICKSTART), f"README.md quickstart blocks: {sorted(blocks)}"
    return blocks


class ReadmeWorker(WorkerProcess):
    """The README's worker command exactly as written, with the rig's logging and stopping."""

    def __init__(self, command: str, env: dict[str, str], cwd: Path) -> None:
        super().__init__("tasks", env=env, cwd=cwd)
        argv = shlex.split(command)
        assert argv[0] == "celery", f"the README's worker command is not celery: {command!r}"
        # This interpreter's ``celery`` entry point: the one ``pip install`` put on the PATH.
        self._argv = [str(Path(sys.executable).with_name("celery")), *argv[1:]]

    def argv(self) -> list[str]:
        return self._argv


def test_quickstart_blocks_are_marked_once_each() -> None:
    blocks = quickstart_blocks(README.read_text())
    for name in ("tasks.py", "call.py"):
        compile(blocks[name], name, "exec")  # a syntax error names the block


def test_the_install_line_installs_this_repository() -> None:
    (line,) = [
        line.split("#", 1)[0].strip()
        for line in quickstart_blocks(README.read_text())["install"].splitlines()
    ]
    assert shlex.split(line)[:2] == ["pip", "install"] and shlex.split(line)[-1] == "."
    # The distribution ``pip install .`` makes, and the code it runs: this clone's.
    assert importlib.metadata.version("celery_guard")
    assert Path(celery_guard.__file__).resolve().is_relative_to(ROOT), "installed from elsewhere"


@pytest.mark.parametrize("store", ["postgresql", "sqlite"])
def test_the_quick_start_runs_as_written_and_prints_what_it_says(
    store: str, postgres: PostgresServer, redis_server: RedisServer, tmp_path: Path
) -> None:
    blocks = quickstart_blocks(README.read_text())
    for name in ("tasks.py", "call.py"):
        (tmp_path / name).write_text(blocks[name])
    store_url = (
        postgres.create_database(f"readme_{uuid.uuid4().hex[:8]}")
        if store == "postgresql"
        else "sqlite:///shop.sqlite3"  # relative, as the README writes it: the worker's directory
    )
    env = {
        "SHOP_BROKER_URL": redis_server.url_for(REDIS_DB),
        "SHOP_RESULT_URL": redis_server.url_for(REDIS_DB),
        "SHOP_STORE_URL": store_url,
        # Only the README's directory on the path, as for a reader (not this repository's).
        "PYTHONPATH": "",
    }
    with redis_server.client(REDIS_DB) as client:
        client.flushdb()  # a leftover message of an earlier run would be consumed here
    worker = ReadmeWorker(blocks["worker"].strip(), env, tmp_path)
    worker.start(timeout=90)
    try:
        for run in (1, 2):
            completed = subprocess.run(
                [sys.executable, "call.py"],
                cwd=tmp_path,
                env={**os.environ, **env},
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert completed.returncode == 0, f"run {run}: {completed.stderr}"
            assert completed.stdout == blocks["output"], f"run {run} printed other than README"
    finally:
        exit_code = worker.stop()
    assert exit_code == 0, worker.log_text()

    # What the output stands for: one execution, its row and the key's COMPLETED marker.
    url = store_url if store == "postgresql" else f"sqlite:///{tmp_path / 'shop.sqlite3'}"
    guard_store = SqlStore(GuardConfig(store_url=url))
    try:
        record = guard_store.get("charge:42")
        assert record is not None and (record.state, record.attempts) == ("COMPLETED", 1)
        assert record.duplicates == 3, "three of the four deliveries ran nothing"
        with guard_store.engine.connect() as connection:
            rows = connection.execute(text("SELECT order_id, amount FROM payments")).all()
        assert [tuple(row) for row in rows] == [(42, 100)]
    finally:
        guard_store.dispose()
    assert "Traceback" not in worker.log_text(), worker.log_text()


def test_every_guard_key_the_readme_names_is_a_setting_and_every_setting_has_a_row() -> None:
    """The Configuration table and the code agree both ways; other ``guard_*`` names are headers."""
    readme = README.read_text()
    settings = {CONFIG_PREFIX + field.name for field in dataclasses.fields(GuardConfig)}
    rows = set(re.findall(r"^\| `(guard_\w+)` \|", readme, re.MULTILINE))
    assert rows - settings == set(), "README.md's Configuration table names unknown settings"
    assert settings - rows == set(), "settings missing from README.md's Configuration table"
    headers = {HEADER_KEY, HEADER_KEY_SOURCE, PUBLISHED_AT_HEADER}
    named = set(re.findall(r"\bguard_\w+", readme))
    assert named - settings - headers == set(), "README.md names guard_* keys that do not exist"
