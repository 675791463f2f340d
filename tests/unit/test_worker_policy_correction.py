"""PolicyWorker updates with actor.rollout_correction: the weights reach the loss, the metrics reach
the update's metrics (max as a max), a missing rollout_log_probs is a clear error, and "none" is
bit-identical to an update without correction."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms.rollout_correction import IS_CLIPPED, IS_MAX, IS_MEAN
from hybridflow.batch import BatchError
from tests.unit._worker_helpers import prompt_batch, tiny_cfg, weights, with_advantages
from workers.policy import PolicyWorker


def _batch(worker: PolicyWorker):
    """4 trajectories with recomputed old_log_probs; row i's behaviour log-probs are old − 0.5·i, so
    its raw weight π_old/π_behav is e^{0.5 i} = 1, 1.65, 2.72, 4.48 on every response token."""
    batch = with_advantages(worker.compute_log_probs(worker.generate_sequences(prompt_batch(worker.tokenizer), seed=1)))
    shift = 0.5 * torch.arange(len(batch), dtype=torch.float32).unsqueeze(1)
    mask = batch["response_mask"]
    batch.set("rollout_log_probs", (batch["old_log_probs"] - shift).masked_fill(~mask, 0.0))
    assert mask.sum(-1).min() >= 1  # every row has a response token, so the max is row 3's
    return batch


@pytest.mark.parametrize(
    "overrides, threshold",
    [(["actor.rollout_correction=tis"], 2.0),
     (["actor.rollout_correction=decoupled", "actor.behav_weight_cap=2.0"], 2.0)],
)
def test_update_with_a_correction_runs_and_reports_the_weights(overrides, threshold):
    worker = PolicyWorker(tiny_cfg(*overrides))
    assert not worker.cfg.old_log_probs_from_rollout  # the correction needs recomputed old_log_probs
    batch = _batch(worker)
    mask = batch["response_mask"]
    raw = torch.exp(batch["old_log_probs"] - batch["rollout_log_probs"])[mask]
    before = weights(worker.module)
    metrics = worker.update_policy(batch, expected_version=0, batch_id="b0")
    assert metrics["actor/update_skipped"] == 0.0 and worker.get_weights_version() == 1
    assert any(not torch.equal(before[k], v) for k, v in weights(worker.module).items())
    # token mean over the 2 micro-batches; the max over them (a mean of micro-batch maxima would be lower)
    assert metrics[IS_MEAN] == pytest.approx(float(raw.mean()), rel=1e-5)
    assert metrics[IS_MAX] == pytest.approx(math.exp(1.5), rel=1e-5)
    assert metrics[IS_CLIPPED] == pytest.approx(float((raw > threshold).float().mean()))
    assert 0 < metrics[IS_CLIPPED] < 1  # rows 2 and 3 are truncated (tis) / rejected (decoupled)


def test_a_correction_without_rollout_log_probs_names_the_field_and_the_engine():
    worker = PolicyWorker(tiny_cfg("actor.rollout_correction=tis"))
    batch = _batch(worker)
    batch.tensors.pop("rollout_log_probs")
    with pytest.raises(BatchError, match=r"rollout_correction=tis needs rollout_log_probs.*rollout.engine=hf"):
        worker.update_policy(batch, expected_version=0, batch_id="b0")
    assert worker.get_weights_version() == 0


def test_none_passes_no_weights_and_unit_weights_change_no_bit():
    plain, tis = PolicyWorker(tiny_cfg()), PolicyWorker(tiny_cfg("actor.rollout_correction=tis"))
    batch = _batch(plain)
    batch.set("rollout_log_probs", batch["old_log_probs"].clone())  # behaviour = old: every weight exactly 1.0
    seen: list[set[str]] = []
    loss_fn = plain.policy_loss

    def spy(*args, **kwargs):
        seen.append(set(kwargs))
        return loss_fn(*args, **kwargs)

    plain.policy_loss = spy
    m_plain = plain.update_policy(batch, expected_version=0, batch_id="b0")
    m_tis = tis.update_policy(batch, expected_version=0, batch_id="b0")
    assert seen and all("token_weights" not in s for s in seen)  # none: the loss runs as before
    assert IS_MEAN not in m_plain and IS_MAX not in m_plain
    assert m_tis[IS_MEAN] == m_tis[IS_MAX] == 1.0 and m_tis[IS_CLIPPED] == 0.0
    assert m_plain["actor/pg_loss"] == m_tis["actor/pg_loss"]
    assert m_plain["actor/grad_norm"] == m_tis["actor/grad_norm"]
    after_tis = weights(tis.module)
    for name, w in weights(plain.module).items():
        assert torch.equal(w, after_tis[name]), name


def test_auto_correction_with_a_bf16_rollout_is_tis_end_to_end():
    """issue 41: rollout.dtype auto under bf16-mixed generates in bfloat16 on the float32 module, so
    actor.rollout_correction auto is tis in the worker (the update reports the weights)."""
    worker = PolicyWorker(tiny_cfg("model.precision=bf16-mixed", "rollout.dtype=auto", "actor.rollout_correction=auto"))
    assert (worker.cfg.rollout_dtype, worker.cfg.rollout_correction) == ("bfloat16", "tis")
    assert not worker.cfg.old_log_probs_from_rollout and worker.engine.dtype == torch.bfloat16
    batch = _batch(worker)
    from workers.rollout.packed_weights import packs

    if packs(torch.bfloat16):
        assert worker.engine.fused_decode_reason is None  # generated fused, in bfloat16
    else:  # this CPU's oneDNN cannot pack bfloat16: generated under autocast, saying why
        assert "cannot pack bfloat16" in worker.engine.fused_decode_reason
    metrics = worker.update_policy(batch, expected_version=0, batch_id="b0")
    assert metrics[IS_MAX] == pytest.approx(math.exp(1.5), rel=1e-5) and worker.get_weights_version() == 1
    auto_none = PolicyWorker(tiny_cfg("rollout.dtype=auto", "actor.rollout_correction=auto"))  # fp32: none
    assert auto_none.cfg.rollout_correction == "none"
