"""The policy's chunked LM head (actor.lm_head) gives the full head's log-probs, entropies, gradients
and update, takes the full path wherever it could not reproduce the model's head, and the entropy
is computed only where the loss uses it."""

from __future__ import annotations

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.models import build_tiny_model, build_tiny_tokenizer
from tests.unit._worker_helpers import prompt_batch, tiny_cfg, weights, with_advantages
from tests.unit.test_algorithms_lm_head import LargestWithVocab
from workers import log_probs as L
from workers import shared_prefix
from workers.log_probs import chunked_head_of, sequence_log_probs
from workers.policy import PolicyWorker

TOK = build_tiny_tokenizer()


def _batch(seed: int = 0) -> Batch:
    """Prompts "abc" ×3 (left padded), "hello" ×2, "xy"; ragged responses of ≤ 5 tokens."""
    enc = TOK(["abc"] * 3 + ["hello"] * 2 + ["xy"], return_tensors="pt", padding=True)
    g = torch.Generator().manual_seed(seed)
    rm = torch.arange(5)[None, :] < torch.tensor([5, 2, 4, 1, 5, 3])[:, None]
    ids = torch.randint(5, len(TOK), (6, 5), generator=g).masked_fill(~rm, TOK.pad_token_id)
    return Batch.from_dict({"prompt_ids": enc.input_ids, "prompt_mask": enc.attention_mask.bool(),
                            "response_ids": ids, "response_mask": rm})


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("shared", [True, False])
def test_chunked_head_equals_the_full_head_with_its_gradients(tied, shared, monkeypatch):
    model = build_tiny_model(len(TOK), hidden_size=32, layers=2, seed=0, tie_word_embeddings=tied)
    monkeypatch.setattr(shared_prefix, "shares_prompts", lambda m: shared)  # both forward paths
    monkeypatch.setattr(L, "log_probs_from_hidden",  # 30 response rows in chunks of 7
                        lambda *a, _f=L.log_probs_from_hidden, **k: _f(*a, **k, chunk_rows=7))
    b = _batch()
    mask = b["response_mask"]
    head = model.get_output_embeddings().weight
    assert (head is model.get_input_embeddings().weight) == tied
    out = {}
    for mode in ("chunked", "full"):
        model.zero_grad(set_to_none=True)
        lp, ent = sequence_log_probs(model, b, temperature=0.8, with_entropy=True, entropy_grad=True, lm_head=mode)
        (lp[mask].sum() + 0.3 * ent[mask].sum()).backward()
        out[mode] = (lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (lp_c, ent_c, g_c), (lp_f, ent_f, g_f) = out["chunked"], out["full"]
    torch.testing.assert_close(lp_c[mask], lp_f[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_c[mask], ent_f[mask], rtol=1e-5, atol=1e-5)
    head_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    assert head_name in g_c
    torch.testing.assert_close(g_c[head_name], g_f[head_name], rtol=1e-5, atol=1e-5)
    for n in g_f:  # every other parameter, through the hidden states
        torch.testing.assert_close(g_c[n], g_f[n], rtol=1e-4, atol=1e-6, msg=n)


def test_the_model_forward_never_holds_the_response_logits(monkeypatch):
    model = build_tiny_model(len(TOK), hidden_size=32, layers=2, seed=0)
    monkeypatch.setattr(L, "log_probs_from_hidden",
                        lambda *a, _f=L.log_probs_from_hidden, **k: _f(*a, **k, chunk_rows=4))
    b = _batch()
    rows = {}
    for mode in ("chunked", "full"):
        with LargestWithVocab(len(TOK)) as watch:
            lp, ent = sequence_log_probs(model, b, temperature=1.0, with_entropy=True, entropy_grad=True, lm_head=mode)
            (lp.sum() + ent.sum()).backward()
        rows[mode] = watch.rows
    assert rows["chunked"] <= 4  # the prefix forward keeps the head for 1 position per prompt (3 rows)
    assert rows["full"] >= 6 * 5  # [B, R, V] logits


def test_models_whose_head_it_cannot_reproduce_take_the_full_path():
    from hybridflow.config import load_config
    from hybridflow.models import apply_lora

    plain = build_tiny_model(len(TOK), hidden_size=16, layers=1, seed=0)
    assert chunked_head_of(plain)[0] is not None
    softcapped = build_tiny_model(len(TOK), hidden_size=16, layers=1, seed=0)
    softcapped.config.final_logit_softcapping = 30.0
    other_head = build_tiny_model(len(TOK), hidden_size=16, layers=1, seed=0)

    class ScaledLinear(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    scaled = ScaledLinear(16, len(TOK), bias=False)
    scaled.weight = other_head.lm_head.weight
    other_head.lm_head = scaled
    lora_cfg = load_config(None, ["model.path=tiny", "model.lora_rank=4"]).model
    lora = apply_lora(build_tiny_model(len(TOK), hidden_size=16, layers=1, seed=0), lora_cfg, seed=0)
    b = _batch()
    for model, why in ((softcapped, "final_logit_softcapping"), (other_head, "ScaledLinear"), (lora, "PEFT")):
        parts, reason = chunked_head_of(model)
        assert parts is None and why in reason
        with pytest.raises(ValueError, match="actor.lm_head=chunked"):
            sequence_log_probs(model, b, temperature=1.0, lm_head="chunked")
        with torch.no_grad():  # auto: the model's own logits
            auto, _ = sequence_log_probs(model, b, temperature=1.0, lm_head="auto")
            full, _ = sequence_log_probs(model, b, temperature=1.0, lm_head="full")
        assert torch.equal(auto, full)


def _update(*overrides: str):
    worker = PolicyWorker(tiny_cfg("actor.old_log_probs=recompute", *overrides))
    batch = worker.compute_log_probs(worker.generate_sequences(prompt_batch(worker.tokenizer), seed=1))
    metrics = worker.update_policy(with_advantages(batch), expected_version=0, batch_id="b")
    return batch, weights(worker.module), metrics


@pytest.mark.parametrize("entropy_coef", ["0", "0.01"])
def test_one_update_gives_the_same_weights_with_the_chunked_and_the_full_head(entropy_coef):
    b_c, w_c, m_c = _update("actor.lm_head=chunked", f"actor.entropy_coef={entropy_coef}")
    b_f, w_f, m_f = _update("actor.lm_head=full", f"actor.entropy_coef={entropy_coef}")
    mask = b_f["response_mask"]
    torch.testing.assert_close(b_c["old_log_probs"][mask], b_f["old_log_probs"][mask], rtol=1e-5, atol=1e-5)
    assert b_c.meta["metrics"]["actor/entropy"] == pytest.approx(b_f.meta["metrics"]["actor/entropy"], rel=1e-5)
    assert m_c["actor/entropy"] == pytest.approx(m_f["actor/entropy"], rel=1e-5)
    assert any(not torch.equal(w, w_f[k]) for k, w in weights(PolicyWorker(tiny_cfg()).module).items())  # it moved
    for k in w_f:
        torch.testing.assert_close(w_c[k], w_f[k], rtol=1e-5, atol=1e-5, msg=k)


def test_auto_chunks_the_tiny_llama_policy():
    worker = PolicyWorker(tiny_cfg())
    assert worker.cfg.actor.lm_head == "auto"
    assert L.resolve_lm_head(worker.model, "auto") is not None


@pytest.mark.parametrize("coef, sampled", [("0", [True, False]), ("0.01", [True, True])])
def test_entropy_is_computed_only_where_the_loss_uses_it(coef, sampled, monkeypatch):
    """entropy_coef = 0: the entropy is a metric, measured on the first micro-batch of each
    mini-batch (detached); with a bonus every micro-batch computes it in the graph."""
    import workers.policy as P

    calls = []
    real = P.sequence_log_probs

    def spy(model, mb, **kw):
        calls.append((kw["with_entropy"], kw["entropy_grad"]))
        lp, ent = real(model, mb, **kw)
        if kw["with_entropy"]:
            assert ent.requires_grad == kw["entropy_grad"]
        return lp, ent

    worker = PolicyWorker(tiny_cfg("actor.old_log_probs=recompute", f"actor.entropy_coef={coef}"))
    batch = with_advantages(worker.compute_log_probs(worker.generate_sequences(prompt_batch(worker.tokenizer), seed=1)))
    monkeypatch.setattr(P, "sequence_log_probs", spy)
    metrics = worker.update_policy(batch, expected_version=0, batch_id="b")
    assert [c[0] for c in calls] == sampled  # one mini-batch of 4 rows, micro-batches of 2
    assert all(grad == (coef != "0") for _, grad in calls)
    assert 0 < metrics["actor/entropy"] < torch.log(torch.tensor(float(len(worker.tokenizer)))).item()
