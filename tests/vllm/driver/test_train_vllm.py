"""Training with rollout.engine=vllm through the CLI, as a user runs it (``make test-vllm``): the
driver in the default runtime, the pools holding a vLLM engine on the vLLM runtime (.venv-vllm).
Two iterations on a tiny model, colocated (the hybrid engine: trainer and vLLM in one actor) and
with a separate rollout pool (asynchronous, trainer.max_staleness=1); the example config loads and
starts; the trainer's maths in the vLLM runtime equal the default runtime's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
TINY = ["model.path=tiny", "model.tiny_hidden_size=128", "data.prompts_per_iteration=2",
        "data.max_prompt_tokens=448", "rollout.samples_per_prompt=2", "rollout.max_response_tokens=6",
        "rollout.kv_cache_gib=0.25", "actor.mini_batch_trajectories=4", "actor.micro_batch_trajectories=2",
        "actor.lr=1e-2", "trainer.total_iterations=2", "trainer.save_every=1", "trainer.val_every=0",
        # float32 on both sides: the tests below bound the trainer/vLLM gap at float32 rounding
        "model.precision=fp32",
        "trainer.val_before_train=false", "tracking.log_model=none", "tracking.system_metrics=false"]


@pytest.fixture()
def workdir(tmp_path):
    from hybridflow.data import write_rows
    from hybridflow.data.tasks import make_arith

    write_rows(make_arith(12, difficulty=0, seed=1), str(tmp_path / "train.parquet"))
    write_rows(make_arith(4, difficulty=0, seed=2), str(tmp_path / "val.parquet"))
    # a random tiny model never answers right: a reward that varies within a group makes the update move
    (tmp_path / "varied.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(len(set(solution_str)) % 3)\n")
    return tmp_path


def _train(workdir: Path, config: str, *extra: str, timeout_s: int = 900) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("RAY_ADDRESS", None)
    script = Path(sys.executable).with_name("hybridflow")
    argv = [str(script), "train", "-c", str(ROOT / config), "data.train_files=[train.parquet]",
            "data.val_files=[val.parquet]", "reward.function=varied.py:compute_score", *TINY, *extra]
    proc = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout_s)
    return proc.returncode, proc.stdout + proc.stderr


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line)["metrics"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _pool_pythons(run: Path) -> set[str]:
    return {e.get("python") for e in map(json.loads, (run / "pool_events.jsonl").read_text().splitlines())} - {None}


def test_colocated_vllm_trains_two_iterations(workdir):
    code, out = _train(workdir, "examples/grpo_arith_vllm.yaml", "trainer.run_id=colo")
    assert code == 0, out[-3000:]
    run = workdir / "runs" / "colo"
    metrics = _metrics(run)
    assert len(metrics) == 2 and (run / "checkpoints" / "iter_000002").is_dir()
    for m in metrics:  # old_log_probs recomputed on the trainer: the gap to vLLM's is measured
        assert 0 <= m["rollout/logprob_diff_max"] < 1e-3
        assert 0 <= m["training/rollout_probs_diff_max"] < 1e-3
    # the updates moved the weights (lr 1e-2), and iteration 2's rollout was generated on them: a vLLM
    # still on the initial weights would be far from the trainer's recompute
    assert all(m["actor/grad_norm"] > 0 for m in metrics)


def test_separate_rollout_pool_on_vllm_trains_two_iterations(workdir):
    code, out = _train(workdir, "examples/grpo_arith_async.yaml", "rollout.engine=vllm", "trainer.run_id=async")
    assert code == 0, out[-3000:]
    metrics = _metrics(workdir / "runs" / "async")
    assert len(metrics) == 2
    assert all(m["timing_s/weight_sync"] > 0 and m["perf/weight_sync_bytes"] > 0 for m in metrics)
    # iteration 1 was generated on the weights the trainer recomputes with; iteration 2 one version behind
    # (one-step off-policy at lr 1e-2: a large gap is expected there, and is what rollout_correction handles)
    assert metrics[0]["rollout/logprob_diff_max"] < 1e-3


def test_streaming_on_vllm_trains_and_its_tokens_carry_their_versions(workdir):
    """trainer.async_mode=stream on the vLLM engine (issue 38): groups generated continuously in
    chunks of 2 tokens, in submission order, so iteration 2's groups start under v0 and continue
    under v1 whatever the timing; every token's log-prob is the one its version gave."""
    from hybridflow.batch import Batch

    code, out = _train(workdir, "examples/grpo_arith_stream.yaml", "rollout.engine=vllm", "trainer.run_id=stream",
                       "trainer.stream_order=submission", "rollout.partial_chunk_tokens=2")
    assert code == 0, out[-3000:]
    run = workdir / "runs" / "stream"
    metrics = _metrics(run)
    assert len(metrics) == 2
    assert metrics[1]["stream/groups_with_several_versions"] > 0 and metrics[1]["rollout/staleness/max"] == 1
    rows = Batch.load(str(run / "iter_000002" / "rollout"))
    versions = rows["rollout_token_versions"][rows["response_mask"]]
    assert set(versions.tolist()) == {0, 1}
    assert metrics[0]["rollout/logprob_diff_max"] < 1e-3  # iteration 1: v0 only, the trainer recomputes at v0


@pytest.mark.parametrize("partial", ["abort", "pause"])
def test_streaming_on_vllm_in_completion_order_interrupts_or_pauses_in_vllms_step_loop(workdir, partial):
    """Completion order on the vLLM engine (issue 38): one engine call per response through vLLM's step
    loop, interrupted at a chunk boundary when newer weights arrive — aborted and re-prefilled
    (``abort``) or continued in place after the load (``pause``). Where an update lands depends on
    timing, so the test checks that the run trains and every token carries a version it could have."""
    from hybridflow.batch import Batch

    code, out = _train(workdir, "examples/grpo_arith_stream.yaml", "rollout.engine=vllm", f"trainer.run_id={partial}",
                       "trainer.stream_order=completion", "rollout.partial_chunk_tokens=2", f"rollout.partial={partial}")
    assert code == 0, out[-3000:]
    run = workdir / "runs" / partial
    metrics = _metrics(run)
    assert len(metrics) == 2 and all(m["actor/grad_norm"] > 0 for m in metrics)
    assert metrics[0]["rollout/staleness/max"] == 0 and metrics[1]["rollout/staleness/max"] <= 1
    if partial == "abort":
        assert all(m["stream/paused_rows"] == 0 for m in metrics)
    rows = Batch.load(str(run / "iter_000002" / "rollout"))
    assert set(rows["rollout_token_versions"][rows["response_mask"]].tolist()) <= {0, 1}


def test_bfloat16_rollouts_train_and_report_the_gap(workdir):
    code, out = _train(workdir, "examples/grpo_arith_vllm.yaml", "rollout.dtype=bfloat16", "trainer.run_id=bf16",
                       "trainer.total_iterations=1")
    assert code == 0, out[-3000:]
    (m,) = _metrics(workdir / "runs" / "bf16")
    assert 0 < m["rollout/logprob_diff_mean"] < 0.5 and 0 < m["training/rollout_probs_diff_mean"] < 0.5


def test_judge_on_vllm_scores_every_trajectory_beside_hf_rollouts(workdir):
    """reward.judge.engine=vllm with rollout.engine=hf (examples/grpo_arith_judge.yaml): only the judge
    pool runs on the vLLM runtime (on the default one, `from vllm import LLM` would fail the run). The
    tiny judge's 4 verdict tokens cannot hold a <score>N</score> tag, so every row is unparsed and
    counted, and the run trains anyway (reward.max_failure_iterations=1)."""
    from hybridflow.batch import Batch

    code, out = _train(workdir, "examples/grpo_arith_judge.yaml", "trainer.run_id=judge", "trainer.total_iterations=1",
                       "reward.judge.engine=vllm", "reward.judge.kv_cache_gib=0.25", "reward.judge.verdict=score_tag",
                       "reward.judge.max_new_tokens=4", "reward.max_failure_iterations=1")
    assert code == 0, out[-3000:]
    run = workdir / "runs" / "judge"
    (m,) = _metrics(run)
    assert m["reward/judge_unparsed"] == 4.0 and m["reward/judge_overlong"] == 0.0  # 2 prompts × 2 samples
    assert m["timing_s/judge"] > 0 and m["judge/tokens_per_s"] > 0 and m["judge/verdict_tokens/mean"] > 0
    verdicts = Batch.load(str(run / "iter_000001" / "judge")).non_tensors["judge_verdict"]
    assert len(verdicts) == 4 and all(v.startswith("Score:") for v in verdicts)  # verdict_prefix + generated text


MATHS = r"""
import json, torch
from hybridflow.config import ModelConfig
from hybridflow.models import load_causal_lm
torch.manual_seed(0)
model = load_causal_lm(ModelConfig(path="tiny", tiny_hidden_size=128))
ids = torch.randint(3, 60, (4, 20))
logp = torch.log_softmax(model(ids).logits.float(), -1)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
loss = -logp[:, :-1].gather(-1, ids[:, 1:, None]).mean()
loss.backward(); opt.step()
after = torch.log_softmax(model(ids).logits.float(), -1)
print(json.dumps({"logp": logp[0, :4, :4].tolist(), "loss": loss.item(), "after": after[0, :4, :4].tolist()}))
"""


def test_trainer_maths_in_the_vllm_runtime_equal_the_default_runtimes():
    """A colocated pool trains in the vLLM runtime (its transformers 5.19, not 5.25): log-probs
    and one AdamW update on the same tiny model agree with the default runtime's."""
    outs = []
    for python in (sys.executable, str(VLLM_PYTHON)):
        proc = subprocess.run([python, "-c", MATHS], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-2000:]
        outs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    import torch

    for key in ("logp", "after"):
        assert torch.allclose(torch.tensor(outs[0][key]), torch.tensor(outs[1][key]), atol=1e-5), key
    assert abs(outs[0]["loss"] - outs[1]["loss"]) < 1e-5
