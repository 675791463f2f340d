"""``rollout.partial: pause`` on the hf engine (workers/rollout/hf_pause.py): new weights loaded in
place between two decode steps, the same rows going on, on the KV cache they hold.

The reference is built with plain transformers forward calls on one DynamicCache: the prompt and
the first K tokens under the old weights, then the new weights loaded into that model in place and
the decode continued on the same cache. The engine must give exactly those tokens (greedy), the old
weights' log-probs for the first K and the new weights' (on the kept KV) after, on every decode path
(fused decoder, packed linears, the plain forward, a compiled step); and they must differ from a
re-prefill of prompt + K tokens under the new weights, so the test sees the KV was kept.
"""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

from hybridflow.models import build_tiny_model, build_tiny_tokenizer
from workers.rollout.base import SamplingParams
from workers.rollout.hf import HFRolloutEngine
from workers.shared_prefix import forward_kwargs

TOK = build_tiny_tokenizer()
TEXTS = ["hello there", "q", "abc", "zz top"]
K, NEW = 4, 10  # pause after K tokens, NEW tokens in all

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/unit/conftest.py

PATHS = {
    "fused": {},
    "packed": {"fused_decode": False},
    "plain": {"fused_decode": False, "packed_weights": False},
    "compiled": {"compile": True},  # ~40 s: one decode-step shape compiled (inductor reads the weights as inputs)
}


def tiny(seed: int) -> torch.nn.Module:
    return build_tiny_model(len(TOK), hidden_size=32, layers=2, seed=seed).eval()


W1 = {k: v.clone() for k, v in tiny(1).state_dict().items()}


def prompts():
    enc = TOK(TEXTS, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"].bool()


def unpadded(i: int) -> list[int]:
    return TOK(TEXTS[i])["input_ids"]


def kept_kv_reference(prompt: list[int], switch_at: int | None, model=None, new=None) -> tuple[list[int], list[float]]:
    """Greedy NEW tokens and their log-probs: prompt and tokens under W0 (``model``, default the seed-0
    tiny model) on one DynamicCache; from the step that feeds token ``switch_at`` on, W1 (``new``)
    loaded in place into the same model (None: never)."""
    model = tiny(0) if model is None else model
    cache, name = DynamicCache(), forward_kwargs(model)[0]
    tokens, lps = [], []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True, **{name: cache})
        for t in range(NEW):
            if t > 0:
                if t == switch_at:
                    model.load_state_dict(W1 if new is None else new)
                out = model(input_ids=torch.tensor([[tokens[-1]]]), use_cache=True, **{name: cache})
            logp = out.logits[0, -1].float().log_softmax(-1)
            tokens.append(int(logp.argmax()))
            lps.append(float(logp[tokens[-1]]))
    return tokens, lps


def reprefill_log_probs(prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Log-probs under W1 of ``tokens`` after ``prompt``, all computed from scratch (what a re-prefill,
    abort-and-resubmit, would report): [len(tokens)] float32."""
    with torch.no_grad():
        logits = tiny(1)(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)


def pausing_engine(**kw):
    model = tiny(0)
    engine = HFRolloutEngine(model, TOK, **kw)
    loads = []

    def pause(unfinished: int) -> bool:
        loads.append(unfinished)
        model.load_state_dict(W1)  # what the streaming rollout's load does to the shared module
        return True

    return engine, model, loads, pause


@pytest.mark.parametrize("path", list(PATHS))
def test_pause_keeps_the_kv_and_decodes_on_with_the_new_weights(path):
    engine, model, loads, pause = pausing_engine(**PATHS[path])
    ids, mask = prompts()
    sampling = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=())
    asked = []
    out = engine.generate(ids, mask, sampling, interrupt=lambda k: asked.append(k) or k == K, pause=pause)
    assert loads == [len(TEXTS)] and asked == list(range(1, NEW))  # one load, every row still going
    if path == "fused":
        assert engine.fused_decode_reason is None
    assert (engine.packed_linears > 0) == (path == "packed") and (engine.compile_stats["compiles"] > 0) == (path == "compiled")
    assert out.response_ids.shape == (len(TEXTS), NEW) and bool(out.response_mask.all())
    assert out.weight_epochs.tolist() == [[0] * K + [1] * (NEW - K)] * len(TEXTS)
    for i in range(len(TEXTS)):
        tokens, lps = kept_kv_reference(unpadded(i), switch_at=K)
        old_tokens, old_lps = kept_kv_reference(unpadded(i), switch_at=None)
        assert out.response_ids[i].tolist() == tokens, i
        assert tokens[:K] == old_tokens[:K]
        got = out.rollout_log_probs[i]
        assert torch.allclose(got[:K], torch.tensor(old_lps[:K]), atol=1e-5, rtol=0)  # the old weights'
        assert torch.allclose(got[K:], torch.tensor(lps[K:]), atol=1e-4, rtol=0)  # new weights, kept KV
        # a re-prefill under the new weights would give other log-probs: the old weights' KV was kept
        gap = (got[K:] - reprefill_log_probs(unpadded(i), tokens)[K:]).abs().max()
        assert gap > 1e-2, (i, float(gap))


@pytest.mark.parametrize("path", ["fused", "packed"])
def test_a_chunk_after_the_pause_decodes_wholly_under_the_new_weights(path):
    """generation_batch_trajectories=2: the pause lands in the first chunk of rows; the second chunk is
    prefilled and decoded under the new weights (epoch 1 throughout), as a fresh call on W1 would."""
    engine, model, loads, pause = pausing_engine(generation_batch_trajectories=2, **PATHS[path])
    ids, mask = prompts()
    sampling = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=())
    out = engine.generate(ids, mask, sampling, interrupt=lambda k: k == K and not loads, pause=pause)
    assert len(loads) == 1
    assert out.weight_epochs[:2].tolist() == [[0] * K + [1] * (NEW - K)] * 2
    assert out.weight_epochs[2:].tolist() == [[1] * NEW] * 2
    fresh = HFRolloutEngine(tiny(1), TOK, **PATHS[path]).generate(ids[2:], mask[2:], sampling)
    assert torch.equal(out.response_ids[2:], fresh.response_ids)
    assert torch.allclose(out.rollout_log_probs[2:], fresh.rollout_log_probs, atol=1e-5, rtol=0)


def test_a_pause_that_declines_ends_the_chunk_as_an_abort():
    engine, model, loads, _ = pausing_engine()
    ids, mask = prompts()
    sampling = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=())
    out = engine.generate(ids, mask, sampling, interrupt=lambda k: k == K, pause=lambda n: False)
    assert out.response_ids.shape == (len(TEXTS), K) and out.weight_epochs.tolist() == [[0] * K] * len(TEXTS)


def test_weight_epochs_are_zero_outside_the_mask_when_rows_stop():
    engine, model, loads, pause = pausing_engine()
    ids, mask = prompts()
    stops = tuple(range(3, len(TOK), 4))  # about a quarter of the vocabulary stops a row
    sampling = SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=3, stop_token_ids=stops)
    out = engine.generate(ids, mask, sampling, interrupt=lambda k: k == 2, pause=pause)
    assert not bool(out.weight_epochs[~out.response_mask].any())
    for i in range(len(TEXTS)):
        n = int(out.response_mask[i].sum())
        assert out.weight_epochs[i, :n].tolist() == ([0] * 2 + [1] * (n - 2))[:n]


def test_pause_is_refused_where_transformers_generate_decodes():
    engine = HFRolloutEngine(tiny(0), TOK, drop_finished_rows=False)
    ids, mask = prompts()
    sampling = SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=())
    with pytest.raises(ValueError, match="rollout.partial=pause needs rollout.drop_finished_rows=true"):
        engine.generate(ids, mask, sampling, interrupt=lambda k: True, pause=lambda n: True)
    with pytest.raises(ValueError, match="needs interrupt="):
        HFRolloutEngine(tiny(0), TOK).generate(ids, mask, sampling, pause=lambda n: True)


@pytest.mark.parametrize("path", ["fused", "packed"])
def test_without_the_refresh_the_copies_would_be_stale(monkeypatch, path):
    """The test above can fail: with the refresh switched off, the fused and packed paths go on after
    the load with their copies of the old weights, and their log-probs are not the kept-KV reference's."""
    from workers.rollout import hf_pause

    monkeypatch.setattr(hf_pause.InPlacePause, "refresh", lambda self: None)
    engine, model, loads, pause = pausing_engine(**PATHS[path])
    ids, mask = prompts()
    sampling = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=())
    out = engine.generate(ids, mask, sampling, interrupt=lambda k: k == K, pause=pause)
    _, lps = kept_kv_reference(unpadded(0), switch_at=K)
    assert not torch.allclose(out.rollout_log_probs[0, K:], torch.tensor(lps[K:]), atol=1e-2, rtol=0)


def test_pause_with_a_lora_adapter_decodes_on_with_the_new_adapter():
    """A peft model (the fused decoder declines it; its base and adapter linears are packed): the new
    adapter is loaded into the shared module in place, the packed lora_A / lora_B copies rebuilt."""
    from hybridflow.config import ModelConfig
    from hybridflow.models import apply_lora

    def lora_model():
        return apply_lora(tiny(0), ModelConfig(path="tiny", lora_rank=4)).eval()

    model = lora_model()
    new = {k: (v + 0.5 * torch.randn(v.shape, generator=torch.Generator().manual_seed(7)) if ".lora_" in k else v)
           for k, v in model.state_dict().items()}  # fmt: skip
    engine = HFRolloutEngine(model, TOK)
    ids, mask = prompts()
    sampling = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=())
    out = engine.generate(ids, mask, sampling, interrupt=lambda k: k == K,
                          pause=lambda n: model.load_state_dict(new) is not None)  # fmt: skip
    assert engine.fused_decode_reason is not None and engine.packed_linears > 0
    for i in range(len(TEXTS)):
        tokens, lps = kept_kv_reference(unpadded(i), switch_at=K, model=lora_model(), new=new)
        assert out.response_ids[i].tolist() == tokens
        assert torch.allclose(out.rollout_log_probs[i], torch.tensor(lps), atol=1e-4, rtol=0)
