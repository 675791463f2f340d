"""The vllm engine's step loop (workers/rollout/vllm_steps.py) and the streamer's ``rollout.partial:
pause`` against a stand-in of vLLM 0.32's ``LLMEngine`` (``add_request`` / ``step`` /
``abort_request`` with ``RequestOutputKind.DELTA`` outputs; n > 1 reported under the parent's id by
``CompletionOutput.index``). The real engine: tests/vllm/engine/test_vllm_partial.py."""

from __future__ import annotations

import threading
import types

import pytest
import torch

from tests.unit.test_rollout_vllm import FakeLLM, RequestOutput, completion, fake_vllm  # noqa: F401
from workers.group_stream import GroupStreamer
from workers.rollout.base import SamplingParams
from workers.rollout.vllm import VLLMRolloutEngine
from workers.rollout.vllm_steps import step_generate

STOP = 2


class FakeLLMEngine:
    """vLLM's step loop: each step adds one token to every live sample. Sample j of request i
    (in add order) samples ``token_fn(i, j, t, weights)`` at its t-th token (log-prob −(t+1)/10 −
    weights) and stops after ``lengths[i]`` tokens with the stop id. ``weights`` is what
    ``load_weights`` last set: a token sampled after a load shows it."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths, self.weights = lengths, 0
        self.requests: dict[str, dict] = {}
        self.aborted: list[str] = []
        self.added: list[tuple[str, list[int], object, object]] = []
        self.steps = 0

    def add_request(self, request_id, prompt, params, lora_request=None):
        i = len(self.added)
        self.added.append((request_id, prompt["prompt_token_ids"], params.output_kind, lora_request))
        self.requests[request_id] = {"i": i, "n": params.n, "t": [0] * params.n, "done": [False] * params.n,
                                     "max": params.max_tokens}

    def token(self, i: int, j: int, t: int) -> int:
        return 10 + 100 * self.weights + 10 * i + j

    def step(self):
        self.steps += 1
        outs = []
        for rid, r in list(self.requests.items()):
            comps = []
            for j in range(r["n"]):
                if r["done"][j]:
                    continue
                t = r["t"][j]
                last = t + 1 >= min(self.lengths[r["i"]], r["max"])
                tok = STOP if last and t + 1 == self.lengths[r["i"]] else self.token(r["i"], j, t)
                reason = ("stop" if tok == STOP else "length") if last else None
                comps.append(completion(j, [tok], [-(t + 1) / 10 - self.weights], reason))
                r["t"][j] += 1
                r["done"][j] = last
            if all(r["done"]):
                del self.requests[rid]
            outs.append(RequestOutput(rid, None, [], None, comps, finished=rid not in self.requests))
        return outs

    def abort_request(self, request_ids, internal=False):
        assert not internal
        self.aborted += request_ids
        for rid in request_ids:
            self.requests.pop(rid)


class Params:
    def __init__(self, n: int, max_tokens: int) -> None:
        self.n, self.max_tokens, self.output_kind = n, max_tokens, None


def test_an_uninterrupted_step_loop_returns_every_sample_in_index_order():
    eng = FakeLLMEngine([3, 5])
    out = step_generate(eng, [{"prompt_token_ids": [5]}, {"prompt_token_ids": [6, 7]}], [Params(2, 8), Params(2, 8)],
                        delta_kind="DELTA")
    assert [[s.token_ids for s in p] for p in out] == [[[10, 10, STOP], [11, 11, STOP]],
                                                        [[20] * 4 + [STOP], [21] * 4 + [STOP]]]
    assert out[0][0].log_probs == pytest.approx([-0.1, -0.2, -0.3]) and out[0][0].finish == "stop"
    assert all(kind == "DELTA" for _, _, kind, _ in eng.added) and eng.aborted == [] and not eng.requests


def test_interrupt_aborts_the_unfinished_requests_natively_and_keeps_their_tokens():
    eng = FakeLLMEngine([2, 9])
    asked = []

    def interrupt(k):
        asked.append(k)
        return k == 4

    out = step_generate(eng, [{"prompt_token_ids": [5]}, {"prompt_token_ids": [6]}], [Params(1, 9), Params(1, 9)],
                        delta_kind="DELTA", interrupt=interrupt)
    assert asked == [1, 2, 3, 4]  # once per step in which the longest unfinished response grew
    assert out[0][0].token_ids == [10, STOP] and out[0][0].finish == "stop"  # finished before the interrupt
    assert out[1][0].token_ids == [20] * 4 and out[1][0].finish is None  # interrupted: shorter, unfinished
    assert out[1][0].log_probs == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert len(eng.aborted) == 1 and eng.aborted[0] == eng.added[1][0] and not eng.requests


def test_pause_loads_weights_between_steps_and_the_same_requests_go_on():
    eng = FakeLLMEngine([6])
    loads = []

    def pause(unfinished):
        loads.append((unfinished, eng.steps))
        eng.weights = 1  # what load_weights does, while no step runs
        return True

    out = step_generate(eng, [{"prompt_token_ids": [5]}], [Params(2, 9)], delta_kind="DELTA",
                        interrupt=lambda k: k == 2 and eng.weights == 0, pause=pause)
    assert loads == [(2, 2)] and eng.aborted == []
    for j, s in enumerate(out[0]):
        assert s.token_ids == [10 + j] * 2 + [110 + j] * 3 + [STOP] and s.finish == "stop"
        assert s.epochs == [0, 0, 1, 1, 1, 1]
        assert s.log_probs == pytest.approx([-0.1, -0.2, -1.3, -1.4, -1.5, -1.6])


def test_a_pause_that_declines_aborts_as_without_it():
    eng = FakeLLMEngine([6])
    out = step_generate(eng, [{"prompt_token_ids": [5]}], [Params(1, 9)], delta_kind="DELTA",
                        interrupt=lambda k: k == 3, pause=lambda unfinished: False)
    assert out[0][0].token_ids == [10] * 3 and out[0][0].finish is None and len(eng.aborted) == 1


def test_an_error_in_the_loop_aborts_every_request_of_the_call():
    eng = FakeLLMEngine([6, 6])

    def interrupt(k):
        raise KeyError("boom")

    with pytest.raises(KeyError):
        step_generate(eng, [{"prompt_token_ids": [5]}, {"prompt_token_ids": [6]}], [Params(1, 9), Params(1, 9)],
                      delta_kind="DELTA", interrupt=interrupt)
    assert sorted(eng.aborted) == sorted(rid for rid, *_ in eng.added) and not eng.requests


# ---- the engine -----------------------------------------------------------------------------------
class StepLLM(FakeLLM):
    """FakeLLM with an ``llm_engine``; like vLLM, ``reset_prefix_cache`` fails while requests hold KV."""

    def __init__(self, lengths):
        super().__init__()
        self.llm_engine = FakeLLMEngine(lengths)

    def reset_prefix_cache(self):
        super().reset_prefix_cache()
        return not self.llm_engine.requests


@pytest.fixture
def fake_vllm_steps(fake_vllm, monkeypatch):  # noqa: F811
    sp = types.ModuleType("vllm.sampling_params")
    sp.RequestOutputKind = types.SimpleNamespace(DELTA="DELTA")
    monkeypatch.setitem(__import__("sys").modules, "vllm.sampling_params", sp)
    return fake_vllm


def test_engine_generate_with_interrupt_reports_unfinished_rows_as_hf_does(fake_vllm_steps):
    llm = StepLLM([2, 9])
    engine = VLLMRolloutEngine(llm, pad_token_id=0)
    ids, mask = torch.tensor([[0, 5], [6, 7]]), torch.tensor([[False, True], [True, True]])
    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=9, stop_token_ids=(STOP,), seed=1),
                          interrupt=lambda k: k == 3)
    assert out.response_ids.tolist() == [[10, STOP, 0], [20, 20, 20]]
    assert out.response_mask.tolist() == [[True, True, False], [True, True, True]]
    assert out.finish_reason == ["stop", "length"]  # "length" though shorter than max_new_tokens: unfinished
    assert out.weight_epochs is None and not any(c[0] == "generate" for c in llm.calls)  # the step loop, not LLM.generate
    assert llm.llm_engine.added[0][1] == [5]  # left padding removed


def test_engine_pause_reloads_in_place_and_resets_the_prefix_cache_once_no_request_runs(fake_vllm_steps):
    from hybridflow.models import build_tiny_model

    llm = StepLLM([6])
    engine = VLLMRolloutEngine(llm, pad_token_id=0)
    model = build_tiny_model(100)

    def pause(unfinished):
        engine.load_weights(model.named_parameters())
        llm.llm_engine.weights = 1
        return True

    out = engine.generate(torch.tensor([[5]]), torch.tensor([[True]]),
                          SamplingParams(max_new_tokens=9, stop_token_ids=(STOP,), n=2, seed=1),
                          interrupt=lambda k: k == 2 and llm.llm_engine.weights == 0, pause=pause)
    assert out.weight_epochs.tolist() == [[0, 0, 1, 1, 1, 1]] * 2 and out.finish_reason == ["stop", "stop"]
    assert out.response_ids[:, 2].tolist() == [110, 111]
    resets = [i for i, c in enumerate(llm.calls) if c[0] == "reset_prefix_cache"]
    assert len(resets) == 2  # refused during the load (requests held KV), done when the call ended
    assert not engine._stale_prefix_cache


def test_engine_pause_refuses_a_new_lora_adapter_mid_generation(fake_vllm_steps):
    llm = StepLLM([6])
    engine = VLLMRolloutEngine(llm, pad_token_id=0)

    def pause(unfinished):
        engine.lora_request = object()
        return True

    with pytest.raises(RuntimeError, match="keeps the adapter it started with"):
        engine.generate(torch.tensor([[5]]), torch.tensor([[True]]), SamplingParams(max_new_tokens=9, seed=1),
                        interrupt=lambda k: k == 2, pause=pause)
    assert not llm.llm_engine.requests  # aborted on the way out


# ---- the streamer with rollout.partial: pause ------------------------------------------------------
def test_the_streamer_pauses_in_place_and_records_each_tokens_version(fake_vllm_steps):
    llm = StepLLM([7, 7])
    engine = VLLMRolloutEngine(llm, pad_token_id=0)
    state = {"loaded": 0, "published": 0}

    def load_newest():
        if state["published"] > state["loaded"]:
            state["loaded"] = state["published"]
            llm.llm_engine.weights = state["loaded"]
        return state["loaded"]

    def newer():
        if llm.llm_engine.steps >= 3:  # the trainer publishes v1 while the call decodes
            state["published"] = 1
        return state["published"] > state["loaded"]

    sampling = SamplingParams(max_new_tokens=9, stop_token_ids=(STOP,), n=2, seed=0)
    st = GroupStreamer(engine, sampling, pad_id=0, chunk_tokens=2, batch_rows=8, order="completion", group_size_iter=1,
                       max_staleness=1, load_newest=load_newest, load_version=lambda v: True,
                       version=lambda: state["loaded"], lock=threading.Lock(), newer_weights=newer, pause=True)
    st.sync([{"gid": 0, "prompt": [5, 6], "seed": 1}])
    work = st._next_work()
    st._generate(*work)
    rec = st.pop([0])[0]
    for j, (tokens, versions) in enumerate(zip(rec["tokens"], rec["versions"], strict=True)):
        # asked at k = 2 (no news), k = 3 (not a boundary), k = 4: v1 loads in place; tokens 5.. are v1's
        assert tokens == [10 + j] * 4 + [110 + j] * 2 + [STOP] and versions == [0] * 4 + [1] * 3
    assert rec["finish"] == ["stop", "stop"] and st.stats["calls"] == 1 and st.stats["paused_rows"] == 2
    assert llm.llm_engine.aborted == []


def test_the_streamer_refuses_pause_on_an_engine_that_cannot():
    from tests.unit.test_rollout_capabilities import PlainEngine

    with pytest.raises(ValueError, match="does not pause in place"):
        GroupStreamer(PlainEngine(), SamplingParams(max_new_tokens=4), pad_id=0, chunk_tokens=2, batch_rows=4,
                      order="completion", group_size_iter=1, max_staleness=1, load_newest=lambda: 0,
                      load_version=lambda v: True, version=lambda: 0, lock=threading.Lock(),
                      newer_weights=lambda: False, pause=True)
