"""A real Prefect server on a home seeded from the migrated template (flows/runtime.py): it comes
up healthy, its database is at the migration head the installed Prefect expects (the server would
otherwise migrate it further), and it serves the registered block types and new flow runs."""

from __future__ import annotations

import json
import sqlite3
import urllib.request
from contextlib import closing

import pytest

pytestmark = pytest.mark.integration


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _head(db) -> str:
    with closing(sqlite3.connect(db)) as c:
        return c.execute("select version_num from alembic_version").fetchone()[0]


def test_a_seeded_home_serves_at_the_migration_head(tmp_path):
    from flows.runtime import prefect_database_template, seed_prefect_database, start_prefect_server

    home = tmp_path / "home"
    home.mkdir()
    assert seed_prefect_database(home)
    head = _head(home / "prefect.db")
    assert head == _head(prefect_database_template())
    server = start_prefect_server(home, timeout_s=180)
    try:
        assert _head(home / "prefect.db") == head  # nothing left to migrate
        assert len(_post(f"{server.url}/block_types/filter", {})) > 10
        flow = _post(f"{server.url}/flows/", {"name": "seeded"})
        run = _post(f"{server.url}/flow_runs/", {"flow_id": flow["id"], "name": "r"})
        assert _post(f"{server.url}/flow_runs/filter", {})[0]["id"] == run["id"]
    finally:
        server.stop()
