"""The vLLM adapter against stand-ins of vLLM's types (vLLM itself cannot be installed here).

The stand-ins mirror vllm 0.33's public shapes: ``RequestOutput(request_id, prompt_token_ids,
outputs)``, ``CompletionOutput(index, text, token_ids, cumulative_logprob, logprobs,
finish_reason, stop_reason)`` with ``logprobs`` a list (one per generated token) of
``{token_id: Logprob(logprob, rank, decoded_token)}``, and ``LLM.generate / collective_rpc /
sleep / wake_up / reset_prefix_cache``.
"""

from __future__ import annotations

import json
import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from hybridflow.config import ModelConfig, RolloutConfig
from hybridflow.models import (
    apply_lora,
    build_tiny_model,
    build_tiny_tokenizer,
    lora_adapter_state,
    save_hf_checkpoint,
)
from tests.unit._worker_helpers import tiny_cfg
from workers.policy import PolicyWorker
from workers.rollout.base import SamplingParams, get_rollout_engine
from workers.rollout.vllm import (
    VLLMRolloutEngine,
    build_requests,
    decoder_layer_of,
    parse_request_outputs,
    split_layers,
    vllm_max_lora_rank,
    vllm_sampling_kwargs,
    vllm_weight_name,
    weight_buckets,
    write_peft_adapter,
)


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: Any
    outputs: list[CompletionOutput]
    finished: bool = True


@dataclass
class FakeSamplingParams:  # the vllm.SamplingParams fields the adapter sets
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    seed: int | None = None
    detokenize: bool = True


def completion(index, token_ids, lps, reason, stop_reason=None, top_extra=False):
    entries = []
    for tok, lp in zip(token_ids, lps, strict=True):
        d = {tok: Logprob(lp, rank=1)}
        if top_extra:  # logprobs=0 may still carry a top-1 alternative when the sample was not the argmax
            d[tok + 1000] = Logprob(-0.01, rank=1)
        entries.append(d)
    return CompletionOutput(index, "", list(token_ids), sum(lps), entries, reason, stop_reason)


def test_sampling_kwargs_map_every_field():
    s = SamplingParams(max_new_tokens=32, temperature=0.7, top_p=0.9, top_k=-1, stop_token_ids=(2, 0), n=4, seed=10)
    kw = vllm_sampling_kwargs(s, prompt_index=3, base_seed=10)
    assert kw == {
        "n": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 0,  # -1 (off) → vLLM's 0 (off)
        "max_tokens": 32,
        "stop_token_ids": [2, 0],
        "ignore_eos": True,
        "logprobs": 0,
        "seed": 10 + 3 * 4,  # vLLM seeds sample j of this prompt with 22 + j: unique across the batch
        "detokenize": False,
    }
    FakeSamplingParams(**kw)  # every key is a real SamplingParams field


def test_build_requests_strips_left_padding():
    ids = torch.tensor([[2, 2, 5, 6], [7, 8, 9, 10]])
    mask = torch.tensor([[False, False, True, True], [True, True, True, True]])
    prompts, params = build_requests(ids, mask, SamplingParams(max_new_tokens=4, n=2), FakeSamplingParams, 100)
    assert prompts == [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7, 8, 9, 10]}]
    assert [p.seed for p in params] == [100, 102]


def test_parse_outputs_into_the_batch_contract():
    s = SamplingParams(max_new_tokens=4, stop_token_ids=(2,), n=2)
    outs = [
        RequestOutput(
            "0",
            None,
            [5, 6],
            None,
            # completions arrive out of order; the stop token 2 is part of token_ids
            [completion(1, [11, 12, 13, 14], [-0.1, -0.2, -0.3, -0.4], "length"),
             completion(0, [21, 2], [-1.0, -0.5], "stop", stop_reason=2, top_extra=True)],
        ),
        RequestOutput("1", None, [7], None, [completion(0, [31], [-2.0], "length"), completion(1, [2], [-0.25], "stop", 2)]),
    ]
    out = parse_request_outputs(outs, s, pad_token_id=2)
    assert out.response_ids.tolist() == [[21, 2, 2, 2], [11, 12, 13, 14], [31, 2, 2, 2], [2, 2, 2, 2]]
    assert out.response_mask.tolist() == [
        [True, True, False, False],
        [True] * 4,
        [True, False, False, False],  # "length" with 1 token (max_tokens reached early in this stand-in)
        [True, False, False, False],  # the stop token alone
    ]
    assert torch.allclose(
        out.rollout_log_probs,
        torch.tensor([[-1.0, -0.5, 0, 0], [-0.1, -0.2, -0.3, -0.4], [-2.0, 0, 0, 0], [-0.25, 0, 0, 0]]),
    )
    assert out.finish_reason == ["stop", "length", "length", "stop"]


def test_parse_rejects_aborted_requests_and_missing_logprobs():
    s = SamplingParams(max_new_tokens=4, stop_token_ids=(2,))
    aborted = [RequestOutput("0", None, [5], None, [completion(0, [3], [-1.0], "abort")])]
    with pytest.raises(RuntimeError, match="'abort'"):
        parse_request_outputs(aborted, s, 2)
    no_lp = [RequestOutput("0", None, [5], None, [CompletionOutput(0, "", [3], None, None, "length")])]
    with pytest.raises(RuntimeError, match="logprobs=0"):
        parse_request_outputs(no_lp, s, 2)


def test_weight_names_and_buckets():
    assert vllm_weight_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == (
        "model.layers.0.self_attn.q_proj.weight"
    )
    assert vllm_weight_name("_orig_mod.model.norm.weight") == "model.norm.weight"
    with pytest.raises(ValueError, match="merged"):
        vllm_weight_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight")
    assert decoder_layer_of("model.layers.12.mlp.up_proj.weight") == "model.layers.12"
    assert decoder_layer_of("model.norm.weight") is None


def _llama_names(layers: int) -> list[tuple[str, torch.Tensor]]:
    per_layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"]
    named = [("model.embed_tokens.weight", torch.zeros(100))]
    for i in range(layers):
        named += [(f"model.layers.{i}.{p}.weight", torch.zeros(25)) for p in per_layer]  # 100 bytes each
    return [*named, ("model.norm.weight", torch.zeros(25)), ("lm_head.weight", torch.zeros(100))]


@pytest.mark.parametrize("bucket_bytes", [1, 250, 900, 1000, 2500, 1 << 30])
def test_buckets_never_split_a_decoder_layer(bucket_bytes):
    """vLLM re-fuses q/k/v and gate/up at the end of each reload call: a layer split over two calls
    comes out corrupt (issue 37: 8 MB buckets, log-prob error 19). Embeddings, final norm and LM
    head go in a bucket of their own; whole layers fill the rest up to bucket_bytes."""
    named = _llama_names(4)
    buckets = list(weight_buckets(named, bucket_bytes))
    assert split_layers(buckets) == []
    assert [n for n, _ in buckets[0]] == ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    assert sorted(n for b in buckets for n, _ in b) == sorted(n for n, _ in named)  # every tensor, once
    layer_bytes = 9 * 100
    per_bucket = max(1, bucket_bytes // layer_bytes)
    assert [len(b) for b in buckets[1:]] == [9 * min(per_bucket, 4 - k) for k in range(0, 4, per_bucket)]


def test_split_layers_names_a_bucket_that_splits_a_fused_group():
    named = [(n, t) for n, t in _llama_names(1) if ".layers." in n]
    assert split_layers([named[:1], named[1:]]) == ["model.layers.0"]  # q apart from k/v


# ---- the engine against a stand-in LLM ----------------------------------------------------------
@dataclass
class FakeWorker:
    """vLLM's worker side of ``collective_rpc("reload_weights", ...)``: records each call's names."""

    loaded: list[str] = field(default_factory=list)
    calls: list[list[str]] = field(default_factory=list)
    model_runner: Any = field(default_factory=lambda: types.SimpleNamespace(
        model=types.SimpleNamespace(config=types.SimpleNamespace(tie_word_embeddings=False))))

    def reload_weights(self, weights_iterator=None, is_checkpoint_format=True):
        assert is_checkpoint_format
        names = [name for name, _ in weights_iterator]
        self.calls.append(names)
        self.loaded.extend(names)


class FakeLLM:
    """Records calls; generates a fixed token pattern: sample j of prompt i is [i*10+j, stop]."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls: list[Any] = []
        self.lora_requests: list[Any] = []
        self.worker = FakeWorker()

    def generate(self, prompts, sampling_params, use_tqdm=True, lora_request=None):
        self.calls.append(("generate", prompts, sampling_params))
        self.lora_requests.append(lora_request)
        outs = []
        for i, (_p, sp) in enumerate(zip(prompts, sampling_params, strict=True)):
            comps = [completion(j, [100 + i * 10 + j, sp.stop_token_ids[0]], [-1.0, -2.0], "stop") for j in range(sp.n)]
            outs.append(RequestOutput(str(i), None, _p["prompt_token_ids"], None, comps))
        return outs

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if callable(method):  # a function run on each worker (re-tying the LM head)
            self.calls.append(("collective_rpc", method.__name__))
            return [method(self.worker, *args, **(kwargs or {}))]
        self.calls.append(("collective_rpc", method))
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return True  # vLLM: False while requests hold KV blocks


@dataclass(kw_only=True)
class FakeLoRARequest:  # vllm.lora.request.LoRARequest's fields; lora_int_id must be > 0
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, got {self.lora_int_id}")


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM
    module.SamplingParams = FakeSamplingParams
    lora = types.ModuleType("vllm.lora")
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = FakeLoRARequest
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_sleep_mode_available=lambda: module.sleep_mode)
    module.sleep_mode = True  # a GPU platform; tests of the CPU build set False
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setitem(sys.modules, "vllm.lora", lora)
    monkeypatch.setitem(sys.modules, "vllm.lora.request", request)
    return module


def test_from_config_builds_llm_on_the_hf_folder(fake_vllm, tmp_path, monkeypatch):
    tok = build_tiny_tokenizer()
    folder = save_hf_checkpoint(build_tiny_model(len(tok)), tok, tmp_path / "policy")
    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.delenv(var, raising=False)
    engine = get_rollout_engine("vllm").from_config(
        tokenizer=tok,
        model_cfg=ModelConfig(path=str(folder)),
        rollout_cfg=RolloutConfig(tensor_parallel_size=2, gpu_memory_utilization=0.4, max_num_seqs=16),
        device="cuda:0",
        max_model_len=512,
        seed=3,
    )
    assert isinstance(engine, VLLMRolloutEngine) and engine.sleep_mode
    assert engine.llm.kwargs == {
        "model": str(folder.resolve()),
        "tokenizer": str(folder.resolve()),
        "dtype": "float32",
        "seed": 3,
        "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.4,
        "enable_sleep_mode": True,
        "logprobs_mode": "processed_logprobs",
        "max_model_len": 512,
        "enforce_eager": False,
        "max_num_seqs": 16,
    }
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # in-process: collective_rpc gets tensors
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ  # a GPU pins nothing


def test_from_config_on_a_cpu_sets_the_kv_cache_in_gib_and_no_sleep_mode(fake_vllm, tmp_path, monkeypatch):
    """vLLM's CPU build refuses sleep mode and reads gpu_memory_utilization as a share of host RAM."""
    fake_vllm.sleep_mode = False
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    engine = get_rollout_engine("vllm").from_config(
        tokenizer=build_tiny_tokenizer(), model_cfg=ModelConfig(path="tiny", tiny_hidden_size=128),
        rollout_cfg=RolloutConfig(engine="vllm", kv_cache_gib=0.25, dtype="bfloat16", max_model_len=300,
                                  engine_kwargs={"swap_space": 0}),
        device="cpu",
    )
    kw = engine.llm.kwargs
    assert kw["kv_cache_memory_bytes"] == 1 << 28 and "gpu_memory_utilization" not in kw
    assert kw["enable_sleep_mode"] is False and kw["enforce_eager"] is True
    assert kw["dtype"] == "bfloat16" and kw["max_model_len"] == 300 and kw["swap_space"] == 0
    assert Path(kw["model"], "config.json").exists()  # "tiny" saved as a folder vLLM can load
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    engine.sleep()  # no sleep mode: nothing happens, and generate does not wait for a wake-up
    assert not engine.sleeping and not any(c[0] == "sleep" for c in engine.llm.calls)


def test_engine_kwargs_cannot_override_what_hybridflow_sets():
    with pytest.raises(ValueError, match=r"rollout.engine_kwargs sets \['dtype'\]"):
        RolloutConfig(engine="vllm", engine_kwargs={"dtype": "float16", "swap_space": 0})


def test_generate_sleep_and_weight_sync_sequence(fake_vllm):
    llm = FakeLLM()
    engine = VLLMRolloutEngine(llm, pad_token_id=0, bucket_bytes=1 << 30)
    ids = torch.tensor([[0, 5], [6, 7]])
    mask = torch.tensor([[False, True], [True, True]])
    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=4, stop_token_ids=(2,), n=2, seed=1))
    assert out.response_ids.tolist() == [[100, 2], [101, 2], [110, 2], [111, 2]]  # prompt-major
    assert out.finish_reason == ["stop"] * 4
    engine.sleep()
    model = build_tiny_model(100)
    engine.load_weights(model.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    assert sorted(llm.worker.loaded) == sorted(names)
    assert llm.worker.calls[0] == ["model.embed_tokens.weight", "model.norm.weight"]  # outside the layers first
    assert [c[0] for c in llm.calls] == [
        "generate",
        "sleep",
        "wake_up",  # weights first, so the sync writes into resident memory
        "collective_rpc",  # embeddings + final norm (lm_head is tied)
        "collective_rpc",  # the decoder layers, whole
        "collective_rpc",  # re-tie the LM head to the new embedding (a no-op for an untied model)
        "wake_up",  # then the KV cache
        "reset_prefix_cache",  # cached prefixes were computed with the old weights
    ]
    assert llm.calls[2] == ("wake_up", ["weights"]) and llm.calls[6] == ("wake_up", ["kv_cache"])
    assert llm.calls[5] == ("collective_rpc", "retie_lm_head_on_worker")
    assert llm.calls[3] == ("collective_rpc", "reload_weights")
    assert not engine.sleeping


# ---- LoRA: only the adapter goes to the engine ---------------------------------------------------
def test_vllm_max_lora_rank_rounds_up_to_an_allowed_value():
    assert [vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 16, 300, 321, 512)] == [1, 8, 8, 16, 16, 320, 512, 512]
    with pytest.raises(ValueError, match="lora_rank=513"):
        vllm_max_lora_rank(513)


def test_from_config_with_lora_enables_it(fake_vllm, tmp_path):
    tok = build_tiny_tokenizer()
    folder = save_hf_checkpoint(build_tiny_model(len(tok)), tok, tmp_path / "policy")
    engine = VLLMRolloutEngine.from_config(tokenizer=tok, model_cfg=ModelConfig(path=str(folder), lora_rank=4),
                                           rollout_cfg=RolloutConfig())
    kw = engine.llm.kwargs
    assert (kw["enable_lora"], kw["max_lora_rank"], kw["max_loras"]) == (True, 8, 1)  # rank 4 → vLLM's 8
    assert kw["model"] == str(folder.resolve())  # the base weights come from the folder, once


def _lora_policy(seed: int = 0, hidden: int = 16):
    """A tiny LoRA policy whose adapters are random (B ≠ 0), as after some training."""
    model = apply_lora(build_tiny_model(100, hidden_size=hidden, layers=1, seed=seed),
                       ModelConfig(path="tiny", lora_rank=2, lora_alpha=4))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g))
    return model


def _lora_params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}


def test_load_lora_adapter_writes_a_peft_folder_and_generate_uses_it(fake_vllm):
    from peft import PeftModel

    llm = FakeLLM()
    engine = VLLMRolloutEngine(llm, pad_token_id=0)
    ids, mask = torch.tensor([[5, 6]]), torch.tensor([[True, True]])
    sampling = SamplingParams(max_new_tokens=2, stop_token_ids=(2,), seed=1)
    engine.generate(ids, mask, sampling)
    assert llm.lora_requests == [None]  # no adapter yet: the base model

    trainer = _lora_policy()
    tensors, peft_config = lora_adapter_state(trainer)
    engine.load_lora_adapter(tensors, peft_config, version=3)
    req = engine.lora_request
    assert (req.lora_name, req.lora_int_id) == ("policy-v3", 1)
    first = Path(req.lora_path)
    assert sorted(p.name for p in first.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    # a real check that the folder is a valid adapter: peft loads it onto a fresh base and gets the
    # trainer's adapter weights exactly, and the same outputs
    loaded = PeftModel.from_pretrained(build_tiny_model(100, hidden_size=16, layers=1, seed=0), str(first))
    want, got = _lora_params(trainer), _lora_params(loaded)
    assert sorted(got) == sorted(want) and len(want) == 8  # q,k,v,o × (A, B) × 1 layer
    assert all(torch.equal(got[n], want[n]) for n in want)
    x = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=x).logits, trainer(input_ids=x).logits)

    engine.generate(ids, mask, sampling)
    assert llm.lora_requests[-1] is req  # generate passes the current adapter

    with torch.no_grad():
        next(p for n, p in trainer.named_parameters() if "lora_B" in n).add_(1.0)  # an update
    engine.load_lora_adapter(*lora_adapter_state(trainer), version=4)
    new = engine.lora_request
    assert (new.lora_name, new.lora_int_id) == ("policy-v4", 2) and Path(new.lora_path).is_dir()
    assert not first.exists()  # the previous version's folder is gone
    assert [c[0] for c in llm.calls].count("collective_rpc") == 0  # base weights were never sent
    engine.generate(ids, mask, sampling)
    assert llm.lora_requests[-1] is new


def test_adapter_ids_are_not_reused_when_a_version_comes_back(fake_vllm):
    # vLLM caches adapters by lora_int_id: an earlier version loaded again (checkpoint) gets a new id
    engine = VLLMRolloutEngine(FakeLLM(), pad_token_id=0)
    trainer = _lora_policy()
    ids = []
    for version in (0, 1, 0):
        engine.load_lora_adapter(*lora_adapter_state(trainer), version=version)
        ids.append(engine.lora_request.lora_int_id)
    assert ids == [1, 2, 3]


def test_write_peft_adapter_refuses_base_weights(tmp_path):
    with pytest.raises(ValueError, match="not LoRA adapter tensors"):
        write_peft_adapter(tmp_path / "a", {"model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2)}, {})
    assert not (tmp_path / "a").exists()


def _policy_with_fake_vllm(*overrides: str) -> tuple[PolicyWorker, FakeLLM]:
    """A tiny PolicyWorker (hf engine; the config refuses vllm on CPU) whose engine is then
    replaced by the vLLM adapter over a stand-in LLM, and synced once, as at start-up."""
    worker = PolicyWorker(tiny_cfg(*overrides))
    llm = FakeLLM()
    worker.engine = VLLMRolloutEngine(llm, pad_token_id=worker.tokenizer.pad_token_id)
    worker._sync_rollout_weights()
    return worker, llm


def test_policy_with_lora_sends_only_the_adapter(fake_vllm):
    worker, llm = _policy_with_fake_vllm("model.lora_rank=2")
    assert "collective_rpc" not in [c[0] for c in llm.calls]  # no base weight went through load_weights
    req = worker.engine.lora_request
    assert req.lora_name == "policy-v0"
    sent = load_file(str(Path(req.lora_path) / "adapter_model.safetensors"))
    # tiny policy: 1 layer × 4 target modules (q, k, v, o) × (lora_A, lora_B) = 8 tensors, nothing else
    assert len(sent) == 8 and all(".lora_A." in n or ".lora_B." in n for n in sent)
    trainer = {n.replace(".default.", "."): p for n, p in worker.inference_module.named_parameters() if p.requires_grad}
    assert sent.keys() == trainer.keys()
    assert all(torch.equal(sent[n], trainer[n].detach()) for n in sent)
    config = json.loads((Path(req.lora_path) / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (2, 16, ["k_proj", "o_proj", "q_proj", "v_proj"])


def test_policy_without_lora_still_sends_merged_weights(fake_vllm):
    worker, llm = _policy_with_fake_vllm()
    assert worker.engine.lora_request is None
    assert sorted(llm.worker.loaded) == sorted(worker.inference_module.state_dict())
