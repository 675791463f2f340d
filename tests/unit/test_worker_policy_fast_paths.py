"""The policy's cheap paths give the same numbers as the slow ones: old_log_probs from the rollout
engine instead of a recompute forward, the LM head only on response positions (logits_to_keep),
and the fused AdamW step."""

from __future__ import annotations

import pytest
import torch

from hybridflow.batch import BatchError
from tasks.rollout import policy_log_probs_from_rollout
from tests.unit._worker_helpers import prompt_batch, tiny_cfg, weights, with_advantages
from workers.log_probs import accepts_logits_to_keep, sequence_log_probs
from workers.policy import PolicyWorker


def test_auto_takes_rollout_log_probs_only_for_the_hf_engine():
    assert tiny_cfg().old_log_probs_from_rollout
    assert not tiny_cfg("actor.old_log_probs=recompute").old_log_probs_from_rollout
    assert not tiny_cfg("rollout.engine=vllm").old_log_probs_from_rollout
    assert tiny_cfg("rollout.engine=vllm", "actor.old_log_probs=rollout").old_log_probs_from_rollout


def test_logits_to_keep_gives_the_same_log_probs_as_the_full_head():
    worker = PolicyWorker(tiny_cfg())
    batch = worker.generate_sequences(prompt_batch(worker.tokenizer), seed=1)
    model = worker.inference_module
    assert accepts_logits_to_keep(model)
    fast, _ = sequence_log_probs(model, batch, temperature=1.0)

    class NoKeep(torch.nn.Module):  # a causal LM whose forward has no logits_to_keep
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, position_ids, use_cache):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=position_ids, use_cache=use_cache)

    slow_model = NoKeep(model)
    assert not accepts_logits_to_keep(slow_model)
    slow, _ = sequence_log_probs(slow_model, batch, temperature=1.0)
    mask = batch["response_mask"]
    assert fast.shape == slow.shape == batch["response_ids"].shape
    torch.testing.assert_close(fast[mask], slow[mask], atol=1e-5, rtol=1e-5)


def test_old_log_probs_from_rollout_equal_the_recompute_and_the_update_reports_the_gap():
    cfg = tiny_cfg()  # auto + hf engine → rollout log-probs
    a, b = PolicyWorker(cfg), PolicyWorker(tiny_cfg("actor.old_log_probs=recompute"))
    gen = a.generate_sequences(prompt_batch(a.tokenizer), seed=1)
    fast = with_advantages(policy_log_probs_from_rollout(gen))
    slow = with_advantages(b.compute_log_probs(b.generate_sequences(prompt_batch(b.tokenizer), seed=1)))
    mask = fast["response_mask"]
    assert torch.equal(fast["response_ids"], slow["response_ids"])
    assert (fast["old_log_probs"][~mask] == 0).all()
    assert (fast["old_log_probs"] - slow["old_log_probs"]).abs()[mask].max() < 1e-4

    m_fast = a.update_policy(fast, expected_version=0, batch_id="b0")
    m_slow = b.update_policy(slow, expected_version=0, batch_id="b0")
    assert 0 <= m_fast["rollout/logprob_diff_max"] < 1e-4
    assert 0 <= m_fast["rollout/logprob_diff_mean"] <= m_fast["rollout/logprob_diff_max"]
    assert "rollout/logprob_diff_max" not in m_slow  # measured by compute_log_probs instead
    for name, w in weights(a.module).items():
        torch.testing.assert_close(w, weights(b.module)[name], atol=1e-5, rtol=1e-4)


def test_rollout_source_without_rollout_log_probs_is_a_clear_error():
    worker = PolicyWorker(tiny_cfg())
    gen = worker.generate_sequences(prompt_batch(worker.tokenizer), seed=1)
    gen.tensors.pop("rollout_log_probs")
    with pytest.raises(BatchError, match="actor.old_log_probs"):
        policy_log_probs_from_rollout(gen)


def test_plain_parameters_get_the_fused_adamw():
    worker = PolicyWorker(tiny_cfg())
    assert worker.optim.optimizer.defaults["fused"] is True


def _ragged(worker: PolicyWorker, lengths=(3, 4, 1, 2)):
    """A rollout whose responses end after ``lengths`` tokens (mask cut short); its two prompts
    differ in length (rows 0-1: "1+1=", rows 2-3: "22+3=")."""
    batch = worker.generate_sequences(prompt_batch(worker.tokenizer), seed=4)
    cut = torch.arange(batch["response_mask"].shape[1])[None, :] < torch.tensor(lengths)[:, None]
    batch.set("response_mask", batch["response_mask"] & cut)
    batch.set("rollout_log_probs", batch["rollout_log_probs"].masked_fill(~batch["response_mask"], 0.0))
    return batch


def test_trimmed_micro_batches_give_the_log_probs_and_update_of_full_width_ones(monkeypatch):
    from hybridflow.batch import Batch

    results = {}
    for trim in (True, False):
        if not trim:
            monkeypatch.setattr(Batch, "trim_padding", lambda self: self)
        worker = PolicyWorker(tiny_cfg("actor.micro_batch_trajectories=1", "actor.old_log_probs=recompute"))
        batch = worker.compute_log_probs(_ragged(worker))
        lp = batch["old_log_probs"].clone()
        metrics = worker.update_policy(with_advantages(batch), expected_version=0, batch_id="b")
        results[trim] = (lp, weights(worker.module), metrics)
    (lp_t, w_t, m_t), (lp_f, w_f, m_f) = results[True], results[False]
    torch.testing.assert_close(lp_t, lp_f)
    for k in w_t:
        torch.testing.assert_close(w_t[k], w_f[k], rtol=1e-5, atol=1e-6)
    assert m_t["actor/pg_loss"] == pytest.approx(m_f["actor/pg_loss"], rel=1e-5, abs=1e-7)
    assert m_t["actor/grad_norm"] == pytest.approx(m_f["actor/grad_norm"], rel=1e-5)


def test_micro_batches_see_only_their_own_width(monkeypatch):
    """Each micro-batch is trimmed to its own longest row; the policy (a plain module, which shares
    prompt forwards) keeps a prompt's rows together, ordered by length; without prompt sharing
    rows are ordered by length alone."""
    from workers.micro_batches import by_length

    worker = PolicyWorker(tiny_cfg("actor.micro_batch_trajectories=2", "actor.old_log_probs=recompute"))
    assert worker.optim.group_by_prompt
    batch = worker.compute_log_probs(_ragged(worker))
    seen = []
    loss = worker._micro_loss

    def record(model, mb, plan):
        seen.append((mb["response_mask"].sum(-1).tolist(), mb["response_ids"].shape[1], mb["advantages"].shape[1],
                     len({tuple(r) for r in mb["prompt_ids"].tolist()})))
        return loss(model, mb, plan)

    monkeypatch.setattr(worker, "_micro_loss", record)
    worker.update_policy(with_advantages(batch), expected_version=0, batch_id="b")
    # rows 0-1 (prompt "1+1=", 3 and 4 response tokens), then rows 2-3 ("22+3=", 1 and 2): one prompt each
    assert seen == [([3, 4], 4, 4, 1), ([1, 2], 2, 2, 1)]
    # by length alone (+1 prompt token for rows 2-3): rows 2, 0, 3, 1
    assert by_length(batch, torch.arange(4)).tolist() == [2, 0, 3, 1]
    assert by_length(batch, torch.arange(4), group_by_prompt=True).tolist() == [0, 1, 2, 3]
    assert by_length(batch, torch.tensor([3, 2, 1, 0]), group_by_prompt=True).tolist() == [2, 3, 0, 1]


def test_update_statistics_do_not_depend_on_micro_batch_grouping():
    """pg_clipfrac / ppo_kl are token means over the update, whatever the micro-batches hold."""
    results = []
    for micro in (1, 4):
        worker = PolicyWorker(tiny_cfg(f"actor.micro_batch_trajectories={micro}", "actor.ppo_epochs=3",
                                       "actor.lr=5e-2", "actor.old_log_probs=recompute"))
        batch = with_advantages(worker.compute_log_probs(_ragged(worker, lengths=(6, 1, 3, 0))))
        results.append(worker.update_policy(batch, expected_version=0, batch_id="b"))
    one, four = results
    assert four["actor/ppo_kl"] != 0.0 and four["actor/pg_clipfrac"] > 0.0  # later epochs moved off-policy
    for k in ("actor/ppo_kl", "actor/pg_clipfrac", "actor/pg_clipfrac_lower"):
        assert one[k] == pytest.approx(four[k], rel=1e-4, abs=1e-7), k
