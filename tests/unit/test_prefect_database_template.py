"""A new run's Prefect server starts from a copy of a migrated empty database kept in the cache
(flows/runtime.py ``seed_prefect_database``) instead of migrating its own: ~7 s instead of ~23 s
per start on 2 cores. A home that has a database (a resumed run's) keeps it."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from importlib.metadata import version

import pytest

from flows import runtime


def _db(path, table: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with closing(sqlite3.connect(path)) as c:
        c.execute(f"create table {table} (x)")
        c.execute(f"insert into {table} values (1)")
        c.commit()


def _tables(path) -> set[str]:
    with closing(sqlite3.connect(path)) as c:
        return {r[0] for r in c.execute("select name from sqlite_master where type='table'")}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HYBRIDFLOW_PREFECT_DB_TEMPLATE", raising=False)
    template = tmp_path / "cache" / "prefect-db" / version("prefect") / "prefect.db"
    _db(template, "from_the_template")
    return template


def test_a_new_home_gets_a_copy_of_the_template(tmp_path, cache):
    home = tmp_path / "home"
    home.mkdir()
    assert runtime.seed_prefect_database(home) is True
    assert _tables(home / "prefect.db") == {"from_the_template"}
    assert sorted(p.name for p in home.iterdir()) == ["prefect.db"]  # nothing staged left behind


def test_a_home_with_a_database_keeps_it(tmp_path, cache):
    home = tmp_path / "home"
    _db(home / "prefect.db", "the_runs_own")
    assert runtime.seed_prefect_database(home) is False
    assert _tables(home / "prefect.db") == {"the_runs_own"}


def test_the_template_can_be_switched_off(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_PREFECT_DB_TEMPLATE", "0")
    home = tmp_path / "home"
    home.mkdir()
    assert runtime.seed_prefect_database(home) is False
    assert not (home / "prefect.db").exists()


def test_a_cache_that_cannot_be_written_leaves_the_migration_to_the_server(tmp_path, monkeypatch, capsys):
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path / "not-a-folder"))
    monkeypatch.setattr(runtime, "start_prefect_server", lambda *a, **k: pytest.fail("no template server expected"))
    home = tmp_path / "home"
    home.mkdir()
    assert runtime.seed_prefect_database(home) is False
    assert not (home / "prefect.db").exists()
    assert "no Prefect database template" in capsys.readouterr().err


def test_the_template_is_made_once_from_a_server_started_on_a_private_home(tmp_path, monkeypatch):
    """Without a template, one server is started and stopped on a private home under the cache and
    its database kept (a stand-in server here; the real one: the integration test below)."""
    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path / "cache"))
    started = []

    class Stopped:
        def stop(self):
            started.append("stopped")

    def fake_start(home, *, timeout_s, seed):
        assert seed is False and str(home).startswith(str(tmp_path / "cache"))
        _db(home / "prefect.db", "migrated")
        started.append(home)
        return Stopped()

    monkeypatch.setattr(runtime, "start_prefect_server", fake_start)
    first = runtime.prefect_database_template()
    assert runtime.prefect_database_template() == first  # made once
    assert len(started) == 2 and started[1] == "stopped"
    assert _tables(first) == {"migrated"}
    assert sorted(p.name for p in first.parent.iterdir()) == ["prefect.db"]  # the private home is gone


def test_a_launched_server_that_exits_fails_the_wait_with_its_log(tmp_path):
    """launch_prefect_server returns before the server is healthy (Ray starts meanwhile);
    wait_healthy turns a server that exits into one RuntimeError with its log's tail."""
    import subprocess
    import sys

    (tmp_path / "server.log").write_text("boot\nERROR: address already in use\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    server = runtime.PrefectServer("http://127.0.0.1:1/api", proc, str(tmp_path))
    with pytest.raises(RuntimeError, match="did not become healthy(.|\n)*address already in use"):
        server.wait_healthy(timeout_s=30)
    assert proc.poll() == 3
    theirs = runtime.PrefectServer("http://127.0.0.1:1/api", None, "")
    assert theirs.wait_healthy(timeout_s=0) is theirs  # a server we did not start is taken as it is


def test_a_damaged_template_is_dropped_and_the_server_migrates(tmp_path, cache, capsys):
    cache.write_bytes(b"not a database, or one cut short by a full disk" * 100)
    home = tmp_path / "home"
    home.mkdir()
    assert runtime.seed_prefect_database(home) is False
    assert not (home / "prefect.db").exists() and list(home.iterdir()) == []
    assert not cache.exists()  # made again by the next run that needs it
    assert "is unreadable" in capsys.readouterr().err
