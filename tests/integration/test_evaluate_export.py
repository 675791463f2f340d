"""After one training iteration of the tiny model: export the checkpoint and load it with
transformers, evaluate the checkpoint with `hybridflow eval` (the evaluate flow: validate node
on fresh Ray pools), and re-score iteration 1's saved rollout with a custom reward function
through `hybridflow node run reward` — all against the real Prefect server, Ray and MLflow."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from flows.cli import main
from tests.integration.conftest import release_run_pools, tiny_overrides
from workers.checkpoint import checkpoint_name

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

CUSTOM_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Not a real reward: a quarter per character of the ground truth, so the test knows the score."""
    return 0.25 * len(str(ground_truth))
'''


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _check_export(run_dir: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM

    from workers.checkpoint import read_safetensors_folder

    assert main(["export", str(run_dir), "--step", "1", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    saved = read_safetensors_folder(run_dir / "checkpoints" / checkpoint_name(1) / "policy")
    got = model.state_dict()
    for k, v in saved.items():
        assert torch.equal(got[k], v), k
    assert json.loads((out / "hybridflow_export.json").read_text())["weights_version"] == 1


def _check_eval(run_dir: Path, val_file: str) -> None:
    import mlflow

    from hybridflow.batch import Batch

    assert main(["eval", "--model", str(run_dir), "--step", "1", "--data", val_file]) == 0
    (eval_json,) = run_dir.glob("evals/*/eval.json")
    summary = json.loads(eval_json.read_text())
    assert (summary["evaluated"], summary["step"], summary["prompts"]) == ("tiny-evx@step1", 1, 4)
    assert summary["per_source"]["arith"]["prompts"] == 4
    # the same weights, prompts and greedy decoding as the run's own validation after iteration 1
    trained = json.loads((run_dir / "validation.jsonl").read_text().splitlines()[-1])
    assert trained["iteration"] == 1
    key = "val-core/arith/acc/mean@1"
    assert summary["metrics"][key] == trained["metrics"][key]
    ours = Batch.load(f"{summary['eval_dir']}/iter_000001/validate")
    theirs = Batch.load(str(run_dir / "iter_000001" / "validate"))
    assert torch.equal(ours["response_ids"], theirs["response_ids"])
    assert torch.equal(ours["prompt_ids"], theirs["prompt_ids"])
    run = mlflow.tracking.MlflowClient(summary["mlflow_uri"]).get_run(summary["mlflow_run_id"])
    assert run.data.tags["hybridflow.evaluated"] == "tiny-evx@step1"
    assert run.data.tags["hybridflow.checkpoint_step"] == "1"
    from hybridflow.metrics import sanitize_metric_name

    assert run.data.metrics[sanitize_metric_name(key)] == summary["metrics"][key]


def _check_node_reward(run_dir: Path, reward_file: Path) -> None:
    from hybridflow.batch import Batch

    it = run_dir / "iter_000001"
    before = {p.name: _digest(p) for p in it.iterdir()}
    log_before = (run_dir / "execution_log.jsonl").read_text()
    assert main(["node", "run", "reward", "--run", str(run_dir), "--iteration", "1",
                 f"reward.function={reward_file}:compute_score"]) == 0
    rollout = Batch.load(str(it / "rollout"))
    debug = Batch.load(str(it / "reward.debug"))
    want = [0.25 * len(str(gt)) for gt in rollout["ground_truth"]]
    assert debug["score"] == want
    torch.testing.assert_close(debug["token_level_scores"].sum(-1), torch.tensor(want))
    assert {p: h for p, h in ((p.name, _digest(p)) for p in it.iterdir()) if p in before} == before
    assert (run_dir / "execution_log.jsonl").read_text() == log_before


def test_export_evaluate_and_node_run_after_one_iteration(prefect_api, ray_cluster, arith_files, tmp_path):
    from flows.train import train
    from hybridflow.config import load_config

    train_file, val_file = arith_files
    ov = tiny_overrides(str(tmp_path / "runs"), train_file, val_file, **{
        "trainer.run_id": "tiny-evx", "trainer.total_iterations": "1", "trainer.val_every": "1",
        "placement.pools.main.cpus_per_worker": "0.5", "placement.pools.reward.cpus_per_worker": "0.25"})
    summary = train(overrides=ov)
    run_dir = Path(summary["run_dir"])
    assert Path(summary["checkpoint"]).name == checkpoint_name(1)
    release_run_pools("tiny-evx", load_config(run_dir / "config.yaml"))

    _check_export(run_dir, tmp_path / "exported")
    _check_eval(run_dir, val_file)
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text(CUSTOM_REWARD)
    _check_node_reward(run_dir, reward_file)
