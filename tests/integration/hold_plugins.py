"""Test-only (``trainer.plugins``): hold a policy call inside the actor until the test kills it.

A test creates ``<run_dir>/holds/<method>-v<version>`` before the run. When the policy actor
runs that call — ``generate_sequences`` at weights_version ``version``, or ``update_policy``
with ``expected_version=version`` — or the rollout actor of asynchronous training generates at
``version`` (``rollout_generate-v<version>``) or files the published weights of ``version``
(``receive_weights-v<version>``), or the policy writes its part of checkpoint
``iter_<k>`` into the staging folder (``save_checkpoint-iter_<k>``: before the checkpoint is committed),
or the policy generates for validation (``validate_generate``: a run's or ``hybridflow eval``'s), it does the work, then claims the marker (atomic rename,
so only the first call holds), publishes its PID in ``<key>.held`` and waits to be killed
before returning. So a SIGKILL lands inside the node's call on the actor, after its work is
done and before its result is returned or recorded, whatever the machine's load; a timing-based
killer can miss a 70 ms tiny-model rollout. Not killed within HOLD_S, the call returns.
Without a marker (or a run id) the patched methods behave as the originals: a process that
imports this module (the pytest driver does, through the train flow's plugin import) is unchanged.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

from workers.policy import PolicyWorker
from workers.rollout_worker import RolloutWorker

HOLD_S = 300.0


def holds_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "holds"


def _hold(worker: PolicyWorker | RolloutWorker, key: str) -> None:
    run_id = worker.cfg.trainer.run_id
    if not run_id:  # a worker outside a named run (e.g. a unit test in a process that imported this)
        return
    holds = holds_dir(Path(worker.cfg.trainer.run_dir) / run_id)
    try:
        os.rename(holds / key, holds / f"{key}.claimed")
    except FileNotFoundError:
        return
    tmp = holds / f"{key}.held.tmp"
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, holds / f"{key}.held")
    deadline = time.monotonic() + HOLD_S
    while time.monotonic() < deadline:
        time.sleep(0.05)


def _patch(name: str, key_of, cls: type = PolicyWorker, positional: tuple[str, ...] = ()) -> None:
    """``key_of(worker, arguments)``: the marker's name for this call, or None; ``arguments`` holds the
    keyword arguments and the positional ones named by ``positional``."""
    original = getattr(cls, name)
    if getattr(original, "__hold_patched__", False):
        return

    @functools.wraps(original)  # keeps the @dispatch protocol attribute
    def held(self, *args, **kwargs):
        key = key_of(self, {**dict(zip(positional, args, strict=False)), **kwargs})
        out = original(self, *args, **kwargs)
        if key is not None:
            _hold(self, key)
        return out

    held.__hold_patched__ = True
    setattr(cls, name, held)


_patch("generate_sequences",  # validation (a run's, or ``hybridflow eval``'s): validate_generate
       lambda w, kw: "validate_generate" if kw.get("validate") else f"generate_sequences-v{w.versions.weights_version}")
_patch("update_policy", lambda w, kw: f"update_policy-v{kw['expected_version']}")
_patch("generate_sequences", lambda w, kw: f"rollout_generate-v{w.weights_version}", RolloutWorker)
# a rollout rank receiving published weights (asynchronous training): receive_weights-v<version>
_patch("receive_weights", lambda w, kw: f"receive_weights-v{kw['version']}", RolloutWorker)
# after the policy's part of checkpoint iter_<k> is in its staging folder, before commit_save moves it
_patch("save_checkpoint", lambda w, kw: f"save_checkpoint-{Path(kw['path']).name.removesuffix('.tmp')}",
       positional=("path",))
