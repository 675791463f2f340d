"""The chaos soak's ``tool_hang`` fault (issue 40; ``make test-chaos``, not the CI short form): a
multi-turn run of the tiny model whose environment step hangs for one seeded row
(tests/chaos/hang_env.py), every time that row is sampled, plus a driver SIGKILL right after the
first hang and ``--resume``. Shown: each hung step is cut at ``rollout.multi_turn.tool_timeout_s``
and counted (``env/errors``), the run goes on to its end, and it ends bitwise equal to the
uninterrupted run that met the same hangs (final weights, every non-timing metric, update ledger).

Selected by ``CHAOS_TOOL_HANG=1`` (``make test-chaos`` sets it)."""

from __future__ import annotations

import io
import json
import os
import random
import time
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from tests.chaos.soak import SAVE_EVERY, _wait_node, env_int, ledger
from tests.fixtures.compare_runs import compare
from tests.integration.conftest import tiny_overrides
from tests.integration.test_reliability_runs import VARIED_REWARD
from tests.train_process import kill_group, start_train

pytestmark = [pytest.mark.chaos, pytest.mark.integration, pytest.mark.timeout(3600)]

SEED = env_int("CHAOS_SEED", 0)
ITERATIONS = 8
TIMEOUT_S = 3.0
ENV = str(Path(__file__).with_name("hang_env.py")) + ":HangOnce"


def _data(d: Path, hang_row: int) -> Path:
    from hybridflow.data import write_rows
    from hybridflow.data.tasks import make_arith

    d.mkdir(parents=True, exist_ok=True)
    rows = make_arith(10, difficulty=0, seed=41)  # 2 prompts an iteration: 5 iterations an epoch
    for i, row in enumerate(rows):
        row["extra_info"]["chaos_hang"] = i == hang_row
    write_rows(rows, str(d / "train.parquet"))
    write_rows(make_arith(2, difficulty=0, seed=42), str(d / "val.parquet"))
    (d / "varied_reward.py").write_text(VARIED_REWARD)
    return d


def _overrides(data: Path, runs: Path, run_id: str, root: Path, ray_address: str) -> list[str]:
    return tiny_overrides(str(runs), str(data / "train.parquet"), str(data / "val.parquet"), **{
        "trainer.run_id": run_id, "trainer.seed": str(SEED), "trainer.total_iterations": str(ITERATIONS),
        "trainer.total_epochs": "100", "trainer.save_every": str(SAVE_EVERY),
        # a turn of 4 tokens leaves budget, so the environment steps (a turn that fills it ends the trajectory)
        "rollout.max_response_tokens": "16", "rollout.multi_turn.max_tokens_per_turn": "4", "rollout.environment": ENV,
        "rollout.multi_turn.max_turns": "2", "rollout.multi_turn.tool_timeout_s": str(TIMEOUT_S),
        "rollout.multi_turn.num_workers": "1",
        "reward.function": f"{data / 'varied_reward.py'}:compute_score",
        "actor.old_log_probs": "recompute", "placement.ray_address": ray_address,
        "tracking.mlflow_uri": f"sqlite:///{root}/mlflow.db"})


def _env_errors(run_dir: Path) -> dict[int, float]:
    """env/errors per iteration (the last record of each iteration in metrics.jsonl)."""
    out: dict[int, float] = {}
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        rec = json.loads(line)
        out[rec["iteration"]] = rec["metrics"].get("env/errors", 0.0)
    return out


@pytest.mark.skipif(os.environ.get("CHAOS_TOOL_HANG") != "1", reason="make test-chaos only (CHAOS_TOOL_HANG=1)")
def test_a_hanging_tool_is_cut_counted_and_the_run_ends_equal(prefect_api, ray_cluster, tmp_path):
    from flows.train import train

    address = ray_cluster.get_runtime_context().gcs_address
    hang_row = random.Random(f"{SEED}-tool_hang").randrange(10)
    data = _data(tmp_path / "data", hang_row)
    print(f"[tool_hang] seed {SEED}: row {hang_row}'s environment step hangs, cut at {TIMEOUT_S:g} s", flush=True)
    ref = Path(train(overrides=_overrides(data, tmp_path / "ref-runs", "reference", tmp_path, address))["run_dir"])
    ref_errors = _env_errors(ref)
    hung = sorted(i for i, n in ref_errors.items() if n)
    assert hung and all(ref_errors[i] == 2.0 for i in hung), ref_errors  # both samples of the row, each time it is drawn

    runs = tmp_path / "runs"
    run_dir = runs / "chaos"
    args = _overrides(data, runs, "chaos", tmp_path, address)
    log = tmp_path / "driver-1.log"
    t0 = time.monotonic()
    proc = start_train(args, log=log)
    killed_at = min(hung[0] + 1, ITERATIONS)
    assert _wait_node(run_dir, (killed_at, "reward"), proc, log), log.read_text(errors="replace")[-3000:]
    kill_group(proc)  # a driver SIGKILL right after the first hang
    print(f"[tool_hang] hangs in iterations {hung}; driver SIGKILLed in iteration {killed_at}, resumed", flush=True)
    log2 = tmp_path / "driver-2.log"
    proc = start_train(["--resume", str(run_dir)], log=log2)
    try:
        assert proc.wait(timeout=1800) == 0, log2.read_text(errors="replace")[-4000:]
    finally:
        kill_group(proc)
    wall = time.monotonic() - t0
    assert _env_errors(run_dir) == ref_errors
    report = io.StringIO()
    with redirect_stdout(report):
        equal = compare(run_dir, ref)
    print("\n".join(f"[tool_hang] {x}" for x in report.getvalue().splitlines()), flush=True)
    assert equal, report.getvalue()
    assert ledger(run_dir) == ledger(ref)
    print(f"[tool_hang] {int(sum(ref_errors.values()))} hung steps in {len(hung)} iterations, each cut at "
          f"{TIMEOUT_S:g} s and counted (env/errors); driver killed and resumed; final state equal; "
          f"chaos run {wall:.0f} s", flush=True)
