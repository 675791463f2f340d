"""`hybridflow node run`: one node on an iteration's saved inputs, output as <node>.debug.

``advantage`` needs no pool, so it runs here without Ray on a hand-made iteration; the reward
node (which needs a reward pool) is exercised by tests/integration/test_evaluate_export.py.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch

from flows.cli import main
from hybridflow.batch import Batch

# 2 prompts (uid a, b) × 2 samples; response masks of lengths 2, 3, 1, 2
MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)


def _scores(values: list[float]) -> torch.Tensor:
    """Each row's score on its last response token (as the reward worker places it)."""
    out = torch.zeros(MASK.shape)
    for i, v in enumerate(values):
        out[i, int(MASK[i].sum()) - 1] = v
    return out


def _reward(values: list[float]) -> Batch:
    return Batch.from_dict({"token_level_scores": _scores(values)},
                           {"uid": ["a", "a", "b", "b"], "score": list(values)})


@pytest.fixture()
def run_dir(tmp_path) -> Path:
    from hybridflow.config import dump_config, load_config

    run = tmp_path / "run-n"
    run.mkdir()
    cfg = load_config(None, ["model.path=tiny", "algorithm.adv_estimator=grpo", "data.prompts_per_iteration=2",
                             "rollout.samples_per_prompt=2", "actor.mini_batch_trajectories=4",
                             "critic.mini_batch_trajectories=4", "rollout.max_response_tokens=3"])
    (run / "config.yaml").write_text(dump_config(cfg))
    rollout = Batch.from_dict(
        {"prompt_ids": torch.full((4, 2), 5), "prompt_mask": torch.ones(4, 2, dtype=torch.bool),
         "response_ids": torch.full((4, 3), 7), "response_mask": MASK, "old_log_probs": torch.zeros(4, 3)},
        {"uid": ["a", "a", "b", "b"], "data_source": ["arith"] * 4, "ground_truth": ["1", "1", "2", "2"]},
    )
    it = run / "iter_000001"
    rollout.save(str(it / "rollout"), run_id="run-n", iteration=1, node="rollout")
    _reward([1.0, 0.0, 1.0, 1.0]).save(str(it / "reward"), run_id="run-n", iteration=1, node="reward")
    (run / "metrics.jsonl").write_text('{"iteration": 1, "metrics": {"critic/score/mean": 0.75}}\n')
    return run


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_advantage_on_saved_inputs_writes_a_debug_output_and_leaves_the_run_alone(run_dir, capsys):
    before = _digest(run_dir)
    assert main(["node", "run", "advantage", "--run", str(run_dir), "--iteration", "1"]) == 0
    out = Batch.load(str(run_dir / "iter_000001" / "advantage.debug"))
    # GRPO: group a scores (1, 0): mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = 0.70711
    #   → A = ±0.5 / (0.70711 + 1e-6) = ±0.70711; group b (1, 1): std 0 → A = 0 / (0 + 1e-6) = 0.
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    want = torch.tensor([[a, a, 0], [-a, -a, -a], [0, 0, 0], [0, 0, 0]])
    torch.testing.assert_close(out["advantages"], want)
    after = _digest(run_dir)
    assert {k: after[k] for k in before} == before  # nothing of the run changed
    assert set(after) - set(before) == {"advantage.debug.safetensors", "advantage.debug.json"}
    printed = capsys.readouterr().out
    assert "critic/score/mean" in printed and "0.75" in printed  # this run's value next to the run's


def test_use_debug_inputs_reads_an_upstream_debug_output(run_dir):
    it = run_dir / "iter_000001"
    _reward([0.0, 0.0, 1.0, 0.0]).save(str(it / "reward.debug"), run_id="run-n", iteration=1, node="reward.debug")
    assert main(["node", "run", "advantage", "--run", str(run_dir), "-i", "1", "--use-debug-inputs",
                 "--output", "adv.alt"]) == 0
    out = Batch.load(str(it / "adv.alt"))
    # group a (0, 0) → 0; group b (1, 0) → ±0.70711 as above
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    want = torch.tensor([[0, 0, 0], [0, 0, 0], [a, 0, 0], [-a, -a, 0]])
    torch.testing.assert_close(out["advantages"], want)


def test_override_changes_the_node(run_dir):
    # Dr. GRPO (no std division): group a → ±0.5
    assert main(["node", "run", "advantage", "--run", str(run_dir), "-i", "1",
                 "algorithm.norm_adv_by_std_in_grpo=false"]) == 0
    out = Batch.load(str(run_dir / "iter_000001" / "advantage.debug"))
    assert out["advantages"][0, 0].item() == pytest.approx(0.5)
    assert out["advantages"][1, 2].item() == pytest.approx(-0.5)


@pytest.mark.parametrize(("argv", "message"), [
    (["nope"], "no node 'nope' in this run's dataflow; nodes: rollout, reward, advantage, update_policy"),
    (["rollout"], "cannot be run on saved inputs: its output depends on the policy weights"),
    (["update_policy"], "cannot be run on saved inputs: it changes the run's policy weights"),
    (["advantage", "algorithm.use_kl_in_reward=true"], "needs 'reference', but iteration 1 has no saved output"),
    (["advantage", "actor.lr=-1"], "actor.lr"),
])
def test_node_run_errors(run_dir, capsys, argv, message):
    name, *overrides = argv
    assert main(["node", "run", name, "--run", str(run_dir), "--iteration", "1", *overrides]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("output", ["reward", "prompts", "../x", "a/b"])
def test_output_may_not_overwrite_the_run(run_dir, capsys, output):
    before = _digest(run_dir)
    assert main(["node", "run", "advantage", "--run", str(run_dir), "-i", "1", "--output", output]) == 2
    assert "give a plain name that is not one of the run's outputs" in capsys.readouterr().err
    assert _digest(run_dir) == before


def test_a_missing_rollout_advises_an_iteration_not_a_node_run_that_is_refused(run_dir, capsys):
    """Issue 40, defect 11: iteration 0 (validation before training) has no rollout; the advice must
    work: `node run rollout` is refused, so name the iterations that saved one."""
    (run_dir / "iter_000000").mkdir()
    assert main(["node", "run", "advantage", "--run", str(run_dir), "--iteration", "0"]) == 2
    err = capsys.readouterr().err
    assert "iteration 0 has no saved output of 'rollout'" in err
    assert "node run rollout ...` first" not in err
    assert "`node run rollout` cannot make it" in err and "iterations with a saved 'rollout': 1" in err


def test_missing_iteration_lists_the_saved_ones(run_dir, capsys):
    assert main(["node", "run", "advantage", "--run", str(run_dir), "--iteration", "4"]) == 2
    assert "has no iteration 4; saved iterations: 1" in capsys.readouterr().err


def test_not_a_run_dir(tmp_path, capsys):
    assert main(["node", "run", "advantage", "--run", str(tmp_path), "--iteration", "1"]) == 2
    assert "is not a run directory" in capsys.readouterr().err


def test_node_run_needs_run_and_iteration(capsys):
    with pytest.raises(SystemExit) as e:
        main(["node", "run", "advantage", "--iteration", "1"])
    assert e.value.code == 2
    assert "--run" in capsys.readouterr().err
