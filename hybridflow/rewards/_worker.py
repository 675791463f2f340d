"""The reward worker process: loads the scorer once, then scores chunks of rows sent over a pipe.

Runs as ``python -m hybridflow.rewards._worker FD`` started by :mod:`hybridflow.rewards.procpool`
(a fresh interpreter, like multiprocessing's ``spawn``, but without re-running the parent's
``__main__``, which breaks under ``python - < script`` and in Ray workers). FD is the child end
of a ``multiprocessing`` Pipe; the first message is ``(sys_path, spec, cfg_dict, plugins)``.
Protocol (tuples over the pipe):

- child → parent at start: ``("ready", reward_names, batched, reward_prefixes)`` or ``("load_error", message)``.
- parent → child: ``("rows", call_id, [(row, payload), ...])`` — score each row, answering
  ``("row", call_id, row, status, value)`` as each finishes (so the parent knows which row a
  hang or crash happened on); ``("batch", call_id, [(row, payload), ...])`` — one batched call,
  answered by ``("batch", call_id, [(status, value), ...])``; ``("stop",)``.

``payload`` = (data_source, solution_str, ground_truth, extra_info, prompt). ``status`` is
"ok" (value = {"score": float, "extra": {...}}), "nan" (None / NaN / inf score) or "error"
(value = a one-line message). Nothing raised by user code leaves this loop.
"""

from __future__ import annotations

import importlib
import math
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

Payload = tuple[str, str, Any, Any, str]


class _Scorer:
    def __init__(self, spec: str | None, cfg_dict: dict[str, Any]) -> None:
        from hybridflow.config import RewardConfig

        self.cfg = RewardConfig.model_validate(cfg_dict)
        self.fn = None
        if spec is not None:
            from hybridflow.rewards.loader import load_reward_function

            self.fn = load_reward_function(spec)

    @property
    def batched(self) -> bool:
        return self.fn is not None and self.fn.batched

    def score_row(self, p: Payload) -> Any:
        if self.fn is None:
            from hybridflow.rewards.registry import default_compute_score

            return default_compute_score(p[0], p[1], p[2], p[3], reward_cfg=self.cfg)
        return self.fn.score_row(p[0], p[1], p[2], p[3])

    def score_batch(self, ps: list[Payload]) -> list[Any]:
        assert self.fn is not None
        return self.fn.score_batch([p[4] for p in ps], [p[1] for p in ps], [p[0] for p in ps],
                                   [p[2] for p in ps], [p[3] for p in ps])  # fmt: skip


def normalise(value: Any) -> tuple[str, Any]:
    """Turn a reward function's return value into (status, value) — see the module docstring."""
    extra: dict[str, Any] = {}
    if isinstance(value, dict):
        if "score" not in value:
            return "error", f"returned a dict without 'score' (keys: {sorted(value)})"
        extra = {str(k): _scalar(v) for k, v in value.items() if k != "score"}
        value = value["score"]
    if value is None:
        return "nan", "returned None"
    try:
        score = float(value)
    except (TypeError, ValueError):
        return "error", f"returned {type(value).__name__} {str(value)[:60]!r}, not a number"
    if not math.isfinite(score):
        return "nan", f"returned {score}"
    return "ok", {"score": score, "extra": extra}


def _scalar(v: Any) -> Any:
    if v is None or isinstance(v, bool | int | float | str):
        return v
    try:
        return float(v)  # numpy / torch scalars
    except (TypeError, ValueError):
        return str(v)


def _error(e: BaseException) -> tuple[str, str]:
    where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    at = f" at {where.filename}:{where.lineno}" if where else ""
    return "error", f"raised {type(e).__name__}: {str(e)[:300]}{at}"


def worker_main(conn: Any, spec: str | None, cfg_dict: dict[str, Any], plugins: list[str]) -> None:
    """Child process entry point (must stay importable without torch for a fast spawn)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops us
    try:
        for mod in plugins:
            importlib.import_module(mod)
        scorer = _Scorer(spec, cfg_dict)
        from hybridflow.rewards.registry import reward_names, reward_prefixes

        conn.send(("ready", reward_names(), scorer.batched, reward_prefixes()))
    except BaseException as e:  # noqa: BLE001 - report anything, including SystemExit
        conn.send(("load_error", f"{type(e).__name__}: {e}"))
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "stop":
            return
        kind, call_id, rows = msg
        if kind == "rows":
            for row, payload in rows:
                try:
                    status, value = normalise(scorer.score_row(payload))
                except BaseException as e:  # noqa: BLE001
                    status, value = _error(e)
                conn.send(("row", call_id, row, status, value))
        else:
            try:
                out = [normalise(v) for v in scorer.score_batch([p for _, p in rows])]
            except BaseException as e:  # noqa: BLE001
                out = [_error(e)] * len(rows)
            conn.send(("batch", call_id, out))


def _exit_with_parent() -> None:
    """Workers live in their own session, so a SIGKILLed trainer would leave a hung one behind:
    a daemon thread ends this process once its parent is gone."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def main() -> None:
    _exit_with_parent()
    conn = Connection(int(sys.argv[1]))
    sys_path, spec, cfg_dict, plugins = conn.recv()
    sys.path[:] = sys_path
    worker_main(conn, spec, cfg_dict, plugins)


if __name__ == "__main__":
    main()
