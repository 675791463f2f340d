"""The hf engine's own decode loop (workers/rollout/decode.py) against transformers' generate."""

from __future__ import annotations

import pytest
import torch

from hybridflow.config import load_config
from hybridflow.models import build_tiny_model, build_tiny_tokenizer
from workers.rollout.base import SamplingParams
from workers.rollout.decode import decode
from workers.rollout.hf import HFRolloutEngine

TOK = build_tiny_tokenizer()
STOPS = (2, *TOK.convert_tokens_to_ids(list("abcde")))  # ~6 % of steps stop on the tiny model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/unit/conftest.py


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(len(TOK), hidden_size=32, layers=2, seed=0).eval()


def prompts(texts):
    enc = TOK(texts, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"].bool()


TEXTS = ["abc", "hello there", "zz top", "q"]


@pytest.mark.parametrize(
    "temperature,top_k,top_p,n,chunk",
    [(0.0, -1, 1.0, 1, 64), (1.0, -1, 1.0, 4, 64), (0.7, 5, 1.0, 3, 5), (1.3, -1, 0.8, 4, 7), (1.0, 10, 0.9, 2, 64)],
)
def test_same_tokens_and_log_probs_as_generate(model, temperature, top_k, top_p, n, chunk):
    ids, mask = prompts(TEXTS)
    sampling = SamplingParams(max_new_tokens=24, stop_token_ids=STOPS, n=n, seed=11, temperature=temperature,
                              top_k=top_k, top_p=top_p)  # fmt: skip
    own = HFRolloutEngine(model, TOK, generation_batch_trajectories=chunk).generate(ids, mask, sampling)
    ref = HFRolloutEngine(model, TOK, generation_batch_trajectories=chunk, drop_finished_rows=False)
    gen = ref.generate(ids, mask, sampling)
    assert torch.equal(own.response_ids, gen.response_ids)
    assert torch.equal(own.response_mask, gen.response_mask) and own.finish_reason == gen.finish_reason
    assert torch.allclose(own.rollout_log_probs, gen.rollout_log_probs, atol=1e-5, rtol=0)
    assert set(own.finish_reason) == {"stop", "length"} or temperature == 0.0


def test_finished_rows_leave_the_batch_and_cost_no_decode_work(model):
    ids, mask = prompts(TEXTS)
    sampling = SamplingParams(max_new_tokens=30, stop_token_ids=STOPS, n=4, seed=5)
    fed = []  # rows of every decode step's forward (one new token per row)
    hook = model.model.register_forward_pre_hook(
        lambda m, a, kw: fed.append(kw["input_ids"].shape[0]) if kw["input_ids"].shape[1] == 1 else None,
        with_kwargs=True)  # fmt: skip
    try:
        own_engine = HFRolloutEngine(model, TOK)
        out = own_engine.generate(ids, mask, sampling)
        own_fed = list(fed)
        fed.clear()
        gen_engine = HFRolloutEngine(model, TOK, drop_finished_rows=False)
        gen_engine.generate(ids, mask, sampling)
    finally:
        hook.remove()
    lengths = out.response_mask.sum(-1)
    assert own_fed == sorted(own_fed, reverse=True) and own_fed[0] == 16 and own_fed[-1] < 16
    # step t feeds exactly the rows still generating at t
    assert own_fed == [int((lengths > t).sum()) for t in range(len(own_fed))]
    assert sum(own_fed) == int(lengths.sum())
    assert own_engine.decode_stats == {"row_steps": int(lengths.sum()), "useful_row_steps": int(lengths.sum())}
    # generate feeds all 16 rows every step until the longest is done
    assert fed == [16] * int(lengths.max())
    assert gen_engine.decode_stats == {"row_steps": 16 * int(lengths.max()), "useful_row_steps": int(lengths.sum())}


def test_progress_counts_rows_as_they_finish(model):
    ids, mask = prompts(TEXTS)
    seen = []
    out = HFRolloutEngine(model, TOK).generate(
        ids, mask, SamplingParams(max_new_tokens=20, stop_token_ids=STOPS, n=2, seed=1),
        progress=lambda done, total: seen.append((done, total)))  # fmt: skip
    stopped = sum(r == "stop" for r in out.finish_reason)
    assert seen[-1] == (8, 8) and all(t == 8 for _, t in seen)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and 0 < stopped
    assert any(0 < d < 8 for d, _ in seen[:-1])  # reported before the end of the call


def test_a_prompt_ending_in_padding_is_refused(model):
    ids = torch.tensor([[5, 6, 0]])
    with pytest.raises(ValueError, match="must end in a real token"):
        decode(model, ids, torch.tensor([[True, True, False]]), SamplingParams(max_new_tokens=2), None, 0)


def test_one_token_prompts_and_the_config_switch(model):
    ids, mask = prompts(["q", "z"])
    sampling = SamplingParams(max_new_tokens=6, stop_token_ids=STOPS, n=2, seed=3)
    own = HFRolloutEngine(model, TOK).generate(ids, mask, sampling)
    gen = HFRolloutEngine(model, TOK, drop_finished_rows=False).generate(ids, mask, sampling)
    assert torch.equal(own.response_ids, gen.response_ids)
    cfg = load_config(None, ["rollout.drop_finished_rows=false"])
    engine = HFRolloutEngine.from_config(model=model, tokenizer=TOK, model_cfg=cfg.model, rollout_cfg=cfg.rollout)
    assert engine.drop_finished_rows is False


# ---- rollout.compile: the decode step compiled on a static KV cache (workers/rollout/compiled.py) ----


@pytest.fixture(scope="module")
def compiled_engine(model):
    return HFRolloutEngine(model, TOK, compile=True)  # one engine: its compiled shapes are reused by every test


@pytest.mark.parametrize("temperature,n,texts", [(0.0, 2, TEXTS), (1.0, 4, TEXTS), (0.0, 1, ["q", "z"])])
def test_compiled_step_matches_the_eager_loop(model, compiled_engine, temperature, n, texts):
    ids, mask = prompts(texts)
    sampling = SamplingParams(max_new_tokens=24, stop_token_ids=STOPS, n=n, seed=11, temperature=temperature)
    eager_engine = HFRolloutEngine(model, TOK)
    eager = eager_engine.generate(ids, mask, sampling)
    got = compiled_engine.generate(ids, mask, sampling)
    assert torch.equal(got.response_ids, eager.response_ids) and got.finish_reason == eager.finish_reason
    assert torch.equal(got.response_mask, eager.response_mask)
    assert torch.allclose(got.rollout_log_probs, eager.rollout_log_probs, atol=1e-5, rtol=0)
    stats = compiled_engine.decode_stats
    assert stats["useful_row_steps"] == eager_engine.decode_stats["useful_row_steps"] == int(got.response_mask.sum())
    rows, steps = got.response_ids.shape
    assert stats["useful_row_steps"] <= stats["row_steps"] <= rows * steps
    if temperature > 0:  # rows stop at different steps: once half are done, the rest move to a smaller bucket
        assert {"stop", "length"} <= set(got.finish_reason) and stats["row_steps"] < rows * steps


def test_compiled_shapes_are_compiled_once_per_engine(compiled_engine):
    ids, mask = prompts(TEXTS)
    first = compiled_engine.generate(ids, mask, SamplingParams(max_new_tokens=24, stop_token_ids=STOPS, n=4, seed=11))
    before = dict(compiled_engine.compile_stats)
    assert before["compiles"] >= 1 and before["compile_seconds"] > 0
    again = compiled_engine.generate(ids, mask, SamplingParams(max_new_tokens=24, stop_token_ids=STOPS, n=4, seed=11))
    assert compiled_engine.compile_stats == before  # same shapes: nothing compiled again
    assert torch.equal(first.response_ids, again.response_ids)


def test_batch_and_length_buckets():
    from workers.rollout.compiled import CompiledDecodeStep

    assert [CompiledDecodeStep.batch_bucket(r, 32) for r in (32, 17, 16, 9, 5, 2, 1)] == [32, 32, 16, 16, 8, 2, 1]
    assert [CompiledDecodeStep.batch_bucket(r, 12) for r in (12, 7, 6, 3)] == [12, 12, 8, 4]


def test_compile_config_is_checked(model):
    with pytest.raises(ValueError, match="drop_finished_rows"):
        load_config(None, ["rollout.compile=true", "rollout.drop_finished_rows=false"])
    with pytest.raises(ValueError, match="hf engine"):
        load_config(None, ["rollout.compile=true", "rollout.engine=vllm"])
    with pytest.raises(ValueError, match="single-turn"):
        load_config(None, ["rollout.compile=true", "rollout.tools=[calculator]"])
    with pytest.raises(ValueError, match="drop_finished_rows"):
        HFRolloutEngine(model, TOK, drop_finished_rows=False, compile=True)
    cfg = load_config(None, ["rollout.compile=true"])
    engine = HFRolloutEngine.from_config(model=model, tokenizer=TOK, model_cfg=cfg.model, rollout_cfg=cfg.rollout)
    assert engine.compiled_step is not None and engine.compile_stats == {"compiles": 0, "compile_seconds": 0.0}


def test_a_model_cast_after_compiling_gets_caches_of_its_own():
    model = build_tiny_model(len(TOK), hidden_size=32, layers=2, seed=1).eval()
    engine = HFRolloutEngine(model, TOK, compile=True)
    ids, mask = prompts(["q", "z"])
    sampling = SamplingParams(max_new_tokens=8, stop_token_ids=STOPS, n=1, seed=2, temperature=0.0)
    engine.generate(ids, mask, sampling)
    shapes = engine.compile_stats["compiles"]
    model.double()  # same shapes, another dtype: a float32 cache must not be reused
    got = engine.generate(ids, mask, sampling)
    assert engine.compile_stats["compiles"] > shapes
    want = HFRolloutEngine(model, TOK).generate(ids, mask, sampling)
    assert torch.equal(got.response_ids, want.response_ids)
    assert torch.allclose(got.rollout_log_probs, want.rollout_log_probs, atol=1e-9, rtol=0)
