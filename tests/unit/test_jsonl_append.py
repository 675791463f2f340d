"""hybridflow/jsonl.py: a run folder's JSON-lines files keep whole lines when an append fails part-way
(a full disk) or an earlier writer died inside its write (found by the chaos soak: a resumed run
failed at its summary on the half metrics line the full disk had left)."""

from __future__ import annotations

import json
import resource
import signal
from contextlib import contextmanager

import fsspec
import pytest

from flows.run_dir import RunDir
from hybridflow.jsonl import append_line
from tasks.versions import _append_ledger, read_ledger
from workers.pool_events import append_event, read_pool_events


@contextmanager
def file_size_limit(nbytes: int):
    """Writes past ``nbytes`` fail part-way with EFBIG (RLIMIT_FSIZE), as a disk that fills up
    inside a write fails with ENOSPC after taking some of its bytes."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)


def test_a_metrics_append_that_fails_part_way_leaves_no_half_line(tmp_path):
    rd = RunDir(tmp_path / "r1")
    rd.fs.makedirs(rd.url, exist_ok=True)
    rd.append_metrics(1, {"a": 1.0})
    before = (tmp_path / "r1" / "metrics.jsonl").read_bytes()
    with file_size_limit(len(before) + 40), pytest.raises(OSError):  # the record is ~2 KB: 40 bytes go in
        rd.append_metrics(2, {f"metric_{i}": float(i) for i in range(100)})
    assert (tmp_path / "r1" / "metrics.jsonl").read_bytes() == before
    rd.append_metrics(2, {"a": 3.0})  # the resumed run goes on
    assert rd.metrics_history() == {1: {"a": 1.0}, 2: {"a": 3.0}}


def test_a_torn_last_line_left_by_a_killed_writer_is_dropped_before_the_next_append(tmp_path):
    path = tmp_path / "updates_policy.jsonl"
    whole = json.dumps({"version_before": 0, "iteration": 1, "ref": {}}) + "\n"
    path.write_text(whole + '{"version_before": 1, "itera')
    _append_ledger(str(tmp_path), "policy", {"version_before": 1, "iteration": 2, "ref": {}})
    assert [e["iteration"] for e in read_ledger(str(tmp_path), "policy")] == [1, 2]


def test_a_torn_line_longer_than_a_read_block_is_dropped_whole(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 1, "metrics": {}}\n' + '{"iteration": 2, "metrics": {"x": "' + "y" * 200_000)
    RunDir(tmp_path).append_metrics(2, {})
    assert RunDir(tmp_path).metrics_history() == {1: {}, 2: {}}


def test_a_file_that_ends_whole_is_appended_to_unchanged(tmp_path):
    path = tmp_path / "pool_events.jsonl"
    append_event(str(tmp_path / "checkpoints"), {"event": "started", "pool": "main", "rank": 0})
    append_event(str(tmp_path / "checkpoints"), {"event": "started", "pool": "main", "rank": 1})
    assert [e["rank"] for e in read_pool_events(str(tmp_path))] == [0, 1]
    assert path.read_text().count("\n") == 2


def test_other_file_systems_append_as_before():
    fs = fsspec.filesystem("memory")
    path = "/jsonl-test/metrics.jsonl"
    append_line(fs, path, '{"iteration": 1}')
    append_line(fs, path, '{"iteration": 2}')
    assert fs.cat(path) == b'{"iteration": 1}\n{"iteration": 2}\n'
    fs.rm("/jsonl-test", recursive=True)
