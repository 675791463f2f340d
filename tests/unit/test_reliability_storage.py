"""Storage faults: a process SIGKILLed in the middle of saving checkpoints leaves the previous
checkpoint loadable with ``latest`` pointing at it; a full disk is a clear error that leaves
``latest`` alone; nothing half-written is ever picked up on resume."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from workers import checkpoint as C

REPO = Path(__file__).resolve().parents[2]

# Saves step 1, 2, 3, ... forever, each a ~16 MB tensor filled with the step number (so a
# torn file would show as the wrong value) plus trainer_state.json {"step": k}; prints k after
# each commit. Writing is what it spends its time on, so a kill lands mid-save.
SAVER = textwrap.dedent("""
    import sys, torch
    from workers import checkpoint as C
    root, start = sys.argv[1], int(sys.argv[2])
    step = start
    while True:
        tmp = C.begin_save(root, step)
        C.save_state({"w": torch.full((4_000_000,), float(step))}, tmp + "/policy_optim/rank_0")
        C.save_state({"b": torch.full((1000,), float(step))}, tmp + "/critic_optim/rank_0")
        C.commit_save(root, step, {"step": step})
        print(step, flush=True)
        step += 1
""")


def _start_saver(root: Path, start: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", SAVER, str(root), str(start)], stdout=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)


def _kill_after_commits(proc: subprocess.Popen, commits: int, delay_s: float) -> int:
    """Wait for ``commits`` committed steps, sleep ``delay_s`` (into the next save), SIGKILL.
    Returns the last step the saver reported committed."""
    last = 0
    try:
        for _ in range(commits):
            line = proc.stdout.readline()
            assert line, "the saver exited early"
            last = int(line)
        time.sleep(delay_s)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what this test started
        proc.wait(timeout=30)
    return last


def _check_loadable(root: Path, at_least: int) -> int:
    path = C.load_latest(root)
    assert path is not None
    pointer = (root / C.LATEST).read_text().strip()
    assert Path(path).name == pointer  # `latest` itself names a complete checkpoint
    step = C.read_trainer_state(path)["step"]
    assert Path(path).name == C.step_name(step) and step >= at_least
    w = C.load_state(Path(path) / "policy_optim" / "rank_0")["w"]
    b = C.load_state(Path(path) / "critic_optim" / "rank_0")["b"]
    assert torch.equal(w, torch.full((4_000_000,), float(step)))
    assert torch.equal(b, torch.full((1000,), float(step)))
    return step


def test_sigkill_mid_save_leaves_the_previous_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    committed = _kill_after_commits(_start_saver(root, 1), commits=2, delay_s=0.0)
    step = _check_loadable(root, at_least=committed)
    # the kill hit the save after `committed`: at most its staging folder is left over
    leftovers = [p.name for p in root.iterdir() if p.name.endswith((".tmp", ".old"))]
    assert all(name.startswith(C.CHECKPOINT_PREFIX) or name == f"{C.LATEST}.tmp" for name in leftovers)
    # a restarted saver resumes from it, saves over the leftovers, and is killed again a bit later
    committed2 = _kill_after_commits(_start_saver(root, step + 1), commits=1, delay_s=0.05)
    assert committed2 == step + 1
    _check_loadable(root, at_least=step + 1)


def test_full_disk_while_a_worker_writes_is_a_clear_error(tmp_path, monkeypatch):
    from tests.unit._worker_helpers import tiny_cfg
    from workers.policy import PolicyWorker

    worker = PolicyWorker(tiny_cfg())
    root = tmp_path / "checkpoints"
    worker.save_checkpoint(C.begin_save(root, 1))
    first = C.commit_save(root, 1, {"policy_version": 0})

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(C, "save_file", disk_full)
    tmp = C.begin_save(root, 2)
    with pytest.raises(C.CheckpointError, match=rf"policy rank 0: cannot write checkpoint to .*{C.checkpoint_name(2)}.*No space left"):
        worker.save_checkpoint(tmp)
    # the step was never committed: latest still names step 1, which still loads
    assert C.load_latest(root) == first
    assert (root / C.LATEST).read_text() == C.checkpoint_name(1)
    monkeypatch.undo()
    worker.load_checkpoint(first)
