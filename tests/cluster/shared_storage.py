"""Checks that every writer of a run used one folder: the driver (lock, run.json, metrics), the Ray
workers on every node (batches, checkpoints, pool events), Prefect's result storage (the node
cache) and the update ledger. The Ray workers run in their own node's working directory
(tests/cluster/ray_cluster.py), so a path resolved against a worker's working directory would
land under ``<node cwd>/...`` instead."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.train_process import wait_train
from workers.checkpoint import checkpoint_name


def wait_watching_lock(proc: subprocess.Popen, log: Path, lock: Path, timeout_s: float = 900) -> tuple[int, dict]:
    """Wait for ``hybridflow train`` while watching ``lock`` (``<run dir>/run.lock``); returns
    (exit code, the lock's JSON as last seen while the run was alive, {} if never)."""
    holder: dict = {}
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            holder = json.loads(lock.read_text()) or holder
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    return wait_train(proc, log, timeout_s=60), holder


def _uris(value: Any) -> list[str]:
    """Every ``"uri"`` value inside a node result (BatchRefs, nested in dicts and lists)."""
    if isinstance(value, dict):
        return [u for k, v in value.items() for u in ([v] if k == "uri" and isinstance(v, str) else _uris(v))]
    if isinstance(value, list):
        return [u for v in value for u in _uris(v)]
    return []


def assert_one_run_folder(run_dir: Path, node_cwds: set[str], iterations: int) -> None:
    """Batches, checkpoints, Prefect results (and the BatchRefs they hold), the ledger and the
    execution log are all in ``run_dir``; the pool ranks ran in node working directories that are
    not the run's parent folder, and none of those holds a stray run folder."""
    run_dir = run_dir.resolve()
    assert (run_dir / "iter_000001" / "rollout.safetensors").is_file()
    assert (run_dir / "checkpoints" / checkpoint_name(iterations) / "policy" / "model.safetensors").is_file()
    ledger = [json.loads(x) for x in (run_dir / "updates_policy.jsonl").read_text().splitlines()]
    assert [e["iteration"] for e in ledger] == list(range(1, iterations + 1))
    records = sorted((run_dir / "prefect-results").iterdir())
    assert records, "no Prefect results in the run folder"
    for rec in records:
        meta = json.loads(rec.read_text())
        assert meta["metadata"]["storage_key"] == str(rec), meta["metadata"]
        uris = _uris(json.loads(meta["result"]))
        assert all(u.startswith(f"{run_dir}/") for u in uris), (rec.name, uris)
    assert any(_uris(json.loads(json.loads(r.read_text())["result"])) for r in records), "no BatchRef in results"
    started = [json.loads(x) for x in (run_dir / "pool_events.jsonl").read_text().splitlines()]
    cwds = {e["cwd"] for e in started if e["event"] == "started"}
    assert cwds and cwds <= node_cwds, (cwds, node_cwds)
    for cwd in node_cwds:
        strays = [p for p in Path(cwd).rglob(run_dir.name)]
        assert strays == [], f"a worker wrote the run under its own working directory: {strays}"
