"""docs/extending.md's examples, each trained for one iteration on the tiny model through the train
flow (Prefect + Ray, as `hybridflow train` runs it).

Run E: the new estimator (example 1), best-of-n (example 2) and the KL probe switched on by
`actor.use_kl_loss=true` (example 3), in one dataflow (tests/integration/extending/combined.py).
Run F: the same dataflow without KL: the KL probe (and the reference node) do not exist, so never run.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import tiny_overrides
from tests.integration.extending import best_of_n

pytestmark = pytest.mark.integration

EXTENDING = "tests.integration.extending"
SAMPLES_PER_PROMPT, PROMPTS = 4, 2


def _train_one_iteration(tmp_path, arith_files, run_id: str, **extra: str) -> Path:
    from flows.train import train

    train_file, val_file = arith_files
    ov = tiny_overrides(str(tmp_path / "runs"), train_file, val_file, **{
        "trainer.run_id": run_id,
        "trainer.total_iterations": "1",
        "trainer.dataflow": f"{EXTENDING}.combined:build_dataflow",
        "reward.function": f"{Path(__file__).parent / 'extending' / 'varied_reward.py'}:compute_score",
        "data.prompts_per_iteration": str(PROMPTS),
        **extra,
    })
    assert train(overrides=ov)["iterations"] == 1
    return tmp_path / "runs" / run_id


def _ran(run_dir: Path) -> Counter:
    from tasks.common import read_execution_log

    return Counter(e["node"] for e in read_execution_log(str(run_dir)) if e["iteration"] == 1)


def _metrics(run_dir: Path) -> dict[str, float]:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["metrics"]


def test_estimator_best_of_n_and_kl_probe_train_one_iteration(prefect_api, ray_cluster, arith_files, tmp_path):
    from hybridflow.batch import Batch

    run_dir = _train_one_iteration(tmp_path, arith_files, "E", **{
        "trainer.plugins": f"[{EXTENDING}.estimator]",
        "algorithm.adv_estimator": "batch_mean_baseline",
        "rollout.samples_per_prompt": str(SAMPLES_PER_PROMPT),
        "actor.use_kl_loss": "true",
    })
    ran = _ran(run_dir)
    assert [ran[n] for n in ("rollout", "reward", "reference", "best_of_n", "kl_probe", "advantage",
                             "update_policy")] == [1] * 7
    it = run_dir / "iter_000001"
    scored = Batch.load(str(it / "rollout")).union(Batch.load(str(it / "reward")))
    trained = Batch.load(str(it / "advantage"))  # what update_policy trained on
    assert len(scored) == PROMPTS * SAMPLES_PER_PROMPT
    # exactly TOP_K rows per prompt, and they are the prompt's best-scored responses
    assert len(trained) == PROMPTS * best_of_n.TOP_K < len(scored)
    score_all, score_kept = scored["token_level_scores"].sum(-1), trained["token_level_scores"].sum(-1)
    for uid in set(scored.non_tensors["uid"]):
        rows = [i for i, u in enumerate(trained.non_tensors["uid"]) if u == uid]
        assert len(rows) == best_of_n.TOP_K
        every = sorted((score_all[i].item() for i, u in enumerate(scored.non_tensors["uid"]) if u == uid),
                       reverse=True)
        assert sorted((score_kept[i].item() for i in rows), reverse=True) == every[: best_of_n.TOP_K]
    # the update's advantages are the user's estimator's: r_i − mean_j r_j over the trained rows
    mask = trained["response_mask"]
    expected = (score_kept - score_kept.mean())[:, None] * mask
    torch.testing.assert_close(trained["advantages"], expected)
    assert score_kept.std() > 0  # the varied reward makes the check above non-trivial
    metrics = _metrics(run_dir)
    assert metrics["best_of_n/kept_score_mean"] == pytest.approx(score_kept.mean().item(), abs=1e-6)
    assert metrics["kl_probe/k3_mean"] >= 0 and "actor/pg_loss" in metrics


def test_kl_probe_is_switched_off_without_kl(prefect_api, ray_cluster, arith_files, tmp_path):
    run_dir = _train_one_iteration(tmp_path, arith_files, "F")
    ran = _ran(run_dir)
    assert ran["best_of_n"] == 1 and ran["advantage"] == 1 and ran["update_policy"] == 1
    assert ran["kl_probe"] == 0 and ran["reference"] == 0
    assert not any(k.startswith("kl_probe/") for k in _metrics(run_dir))
