"""Test-only (``trainer.plugins``): every policy rank stalls after ``update_policy`` at a chosen
version, so a test can kill a node while the pool is inside that update call.

Before the run the test creates ``<run_dir>/stall/update_policy-v<version>``. Each rank that runs
that update does the work, writes ``<run_dir>/stall/rank<r>.waiting`` and waits until the marker
is gone (at most STALL_S), then returns. Without the marker the method is the original.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

from workers.policy import PolicyWorker

STALL_S = 300.0


def stall_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "stall"


def _patch() -> None:
    original = PolicyWorker.update_policy
    if getattr(original, "__stall_patched__", False):
        return

    @functools.wraps(original)  # keeps the @dispatch protocol attribute
    def stalled(self, batch, *, expected_version, batch_id):
        out = original(self, batch, expected_version=expected_version, batch_id=batch_id)
        run_id = self.cfg.trainer.run_id
        d = stall_dir(Path(self.cfg.trainer.run_dir) / run_id) if run_id else None
        marker = d / f"update_policy-v{expected_version}" if d else None
        if marker is not None and marker.exists():
            (d / f"rank{self.rank}.waiting").write_text("")
            deadline = time.monotonic() + STALL_S
            while marker.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return out

    stalled.__stall_patched__ = True
    PolicyWorker.update_policy = stalled


_patch()
