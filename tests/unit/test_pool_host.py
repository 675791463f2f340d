"""WorkerHost (the process behind one pool rank) without Ray: every start is on record in the
run's pool_events.jsonl, with the checkpoint it restored."""

from __future__ import annotations

import os

import torch

from tests.unit._worker_helpers import tiny_cfg
from workers.checkpoint import begin_save, checkpoint_name, commit_save
from workers.host import WorkerHost
from workers.pool import read_pool_events


def _host(cfg, ckpt_root: str | None) -> WorkerHost:
    return WorkerHost(cfg.model_dump(mode="json"), "main", 0, 1, ckpt_root)


def test_each_start_is_recorded_with_what_it_restored(tmp_path):
    cfg = tiny_cfg()
    run_dir = tmp_path / "run"
    ckpt_root = str(run_dir / "checkpoints")

    first = _host(cfg, ckpt_root)
    assert first.ping()["ready"] and first.restored_from is None
    # move the weights, then checkpoint them as step 3
    with torch.no_grad():
        for p in first.workers["policy"].module.parameters():
            p.add_(0.5)
    path = begin_save(ckpt_root, 3)
    first.call("policy", "save_checkpoint", path)
    commit_save(ckpt_root, 3, {"policy_version": 0})

    second = _host(cfg, ckpt_root)  # what a Ray restart runs: __init__ again, in a new process
    events = read_pool_events(str(run_dir))
    assert [(e["event"], e["pool"], e["rank"]) for e in events] == [("started", "main", 0)] * 2
    assert [e["pid"] for e in events] == [os.getpid()] * 2
    assert events[0]["restored_from"] is None
    assert events[1]["restored_from"] == str(run_dir / "checkpoints" / checkpoint_name(3))
    assert second.restored_from == events[1]["restored_from"]
    a, b = first.workers["policy"].module.state_dict(), second.workers["policy"].module.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # the restart serves the checkpoint's weights
    assert read_pool_events(str(run_dir), "reward") == []


def test_no_checkpoint_root_writes_no_events(tmp_path):
    host = _host(tiny_cfg(), None)
    assert host.ping()["ready"]
    assert list(tmp_path.iterdir()) == []
