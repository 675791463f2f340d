"""bf16-mixed training (issue 41) on a tiny random model, without Ray: float32 master weights and
optimizer state after an update, log-probs close to fp32's, the critic likewise, checkpoints in the
master dtype, bf16-true's bfloat16 parameters, and old_log_probs recomputed under bf16-mixed."""

from __future__ import annotations

import pytest
import torch

from hybridflow.precision import resolve_precision, with_resolved_precision
from tests.unit._worker_helpers import prompt_batch, tiny_cfg, with_advantages
from workers.critic import CriticWorker
from workers.policy import PolicyWorker

# measured on the tiny model (hidden 32, 2 layers; a 2-core AMX Xeon, torch 2.13, seeds 1-3): |Δ log p|
# max 0.7-1.1e-3 nats (full head) and 3-5e-4 (chunked float32 head) between bf16 autocast and float32
LOG_PROB_ATOL = 5e-3


def _mixed(*overrides: str):
    return tiny_cfg("model.precision=bf16-mixed", "model.tiny_hidden_size=32", "model.tiny_layers=2", *overrides)


def _dtypes(module: torch.nn.Module) -> set[torch.dtype]:
    return {p.dtype for p in module.parameters()}


def test_bf16_mixed_update_keeps_float32_master_weights_and_optimizer_state(tmp_path):
    worker = PolicyWorker(_mixed())
    fp32 = PolicyWorker(tiny_cfg("model.tiny_hidden_size=32", "model.tiny_layers=2"))
    assert worker.precision.name == "bf16-mixed" and _dtypes(worker.module) == {torch.float32}
    batch = worker.compute_log_probs(worker.generate_sequences(prompt_batch(worker.tokenizer), seed=1))
    ref = fp32.compute_log_probs(batch)  # the same seed-initialised weights, in float32 throughout
    mask = batch["response_mask"]
    diff = (batch["old_log_probs"] - ref["old_log_probs"]).abs()[mask]
    assert 0 < diff.max() < LOG_PROB_ATOL  # not bit-equal: the forward really ran in bfloat16
    assert batch["old_log_probs"].dtype == torch.float32
    out = worker.update_policy(with_advantages(batch), expected_version=0, batch_id="b0")
    assert out["actor/optimizer_steps"] == 1.0 and worker.get_weights_version() == 1
    assert _dtypes(worker.module) == {torch.float32}
    state = worker.optim.optimizer.state
    assert state and all(v.dtype == torch.float32 for s in state.values() for k, v in s.items() if k != "step")
    worker.save_checkpoint(str(tmp_path / "ck"))
    saved = {t.dtype for t in _checkpoint_tensors(tmp_path / "ck")}
    assert torch.bfloat16 not in saved and torch.float32 in saved


def _checkpoint_tensors(folder):
    from safetensors.torch import load_file

    return [t for f in folder.rglob("*.safetensors") for t in load_file(str(f)).values() if t.is_floating_point()]


def test_bf16_mixed_critic_values_are_float32_and_close():
    cfg = _mixed("algorithm.adv_estimator=gae")
    mixed = CriticWorker(cfg)
    plain = CriticWorker(tiny_cfg("algorithm.adv_estimator=gae", "model.tiny_hidden_size=32", "model.tiny_layers=2"))
    policy = PolicyWorker(cfg)
    batch = policy.generate_sequences(prompt_batch(policy.tokenizer), seed=2)
    v_mixed, v_plain = mixed.compute_values(batch)["values"], plain.compute_values(batch)["values"]
    assert v_mixed.dtype == torch.float32 and _dtypes(mixed.module) == {torch.float32}
    assert torch.allclose(v_mixed, v_plain, atol=LOG_PROB_ATOL)


def test_bf16_true_keeps_bfloat16_parameters():
    worker = PolicyWorker(tiny_cfg("model.precision=bf16-true"))
    assert worker.precision.name == "bf16-true" and _dtypes(worker.module) == {torch.bfloat16}


def test_bf16_mixed_recomputes_old_log_probs():
    assert tiny_cfg().old_log_probs_from_rollout
    assert not _mixed().old_log_probs_from_rollout
    auto = tiny_cfg("model.precision=auto")
    assert auto.old_log_probs_from_rollout  # undecided auto: as fp32
    decided = with_resolved_precision(auto, resolve_precision("auto", device_type="cuda", cuda_bf16=True))
    assert not decided.old_log_probs_from_rollout


@pytest.mark.parametrize("lm_head", ["full", "chunked"])
def test_the_log_softmax_stays_float32_under_autocast(lm_head):
    """The LM head path the policy uses (chunked: the custom float32 head outside autocast)."""
    worker = PolicyWorker(_mixed(f"actor.lm_head={lm_head}"))
    batch = worker.compute_log_probs(worker.generate_sequences(prompt_batch(worker.tokenizer), seed=1))
    assert batch["old_log_probs"].dtype == torch.float32 and torch.isfinite(batch["old_log_probs"]).all()
