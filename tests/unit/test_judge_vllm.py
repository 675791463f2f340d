"""``reward.judge.engine: vllm`` in the default runtime, against the stand-in vLLM of
test_rollout_vllm.py: the config, which interpreter the judge pool gets, the preflight's one-line
refusals, and the JudgeWorker building and calling the vllm engine. The real vLLM judge is tested by
``make test-vllm`` (tests/vllm/engine/test_vllm_judge.py, tests/vllm/driver/test_train_vllm.py)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybridflow.config import ConfigError
from tests.unit._worker_helpers import response_batch, tiny_cfg
from tests.unit.test_judge import ON, QUESTIONS, RESPONSES, RUBRIC, TRUTHS
from tests.unit.test_rollout_vllm import FakeLLM, RequestOutput, completion, fake_vllm  # noqa: F401 (fixture)
from workers.vllm_runtime import pool_uses_vllm, vllm_roles, vllm_runtime_env

VLLM_JUDGE = (*ON, "reward.judge.engine=vllm")


# ---- config and interpreter -------------------------------------------------------------------------
def test_the_judge_engine_defaults_to_hf_and_what_a_vllm_judge_needs_is_checked():
    assert tiny_cfg(*ON).reward.judge.engine == "hf"
    assert tiny_cfg(*VLLM_JUDGE, "reward.judge.kv_cache_gib=0.25").reward.judge.kv_cache_gib == 0.25
    with pytest.raises(ConfigError, match="reward.judge.kv_cache_gib=0.25 is for reward.judge.engine=vllm"):
        tiny_cfg(*ON, "reward.judge.kv_cache_gib=0.25")
    shared = "placement.pools.main={workers: 1, cpus_per_worker: 1, roles: [policy, judge]}"
    with pytest.raises(ConfigError, match=r"reward.judge.engine=vllm: placement.pools.main also holds \['policy'\]"):
        tiny_cfg("reward.judge.enable=true", "reward.judge.engine=vllm", shared)
    assert tiny_cfg("reward.judge.enable=true", shared).reward.judge.enable  # an hf judge may share a pool


def test_only_the_judge_pool_runs_on_the_vllm_runtime_when_only_the_judge_uses_vllm(monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_VLLM_PYTHON", "/opt/vllm/bin/python")
    cfg = tiny_cfg(*VLLM_JUDGE)  # rollout.engine stays hf
    assert vllm_roles(cfg) == {"judge"}
    assert pool_uses_vllm(cfg, ["judge"]) and not pool_uses_vllm(cfg, ["policy", "reference"])
    assert vllm_runtime_env(cfg, ["judge"], on_cpu=True)["py_executable"] == "/opt/vllm/bin/python"
    assert vllm_runtime_env(cfg, ["reward"], on_cpu=True) == {}
    hf_judge = tiny_cfg(*ON)
    assert vllm_roles(hf_judge) == set() and vllm_runtime_env(hf_judge, ["judge"], on_cpu=True) == {}
    # a vLLM rollout does not move an hf judge; both on vLLM: all three roles
    both = tiny_cfg(*VLLM_JUDGE, "rollout.engine=vllm", "model.tiny_hidden_size=128")
    assert vllm_roles(both) == {"policy", "rollout", "judge"}
    assert vllm_roles(tiny_cfg(*ON, "rollout.engine=vllm", "model.tiny_hidden_size=128")) == {"policy", "rollout"}


# ---- preflight -----------------------------------------------------------------------------------------
def test_preflight_names_the_judge_engine_when_the_runtime_is_missing(monkeypatch, tmp_path):
    import flows.preflight_vllm as pv

    monkeypatch.setenv("HYBRIDFLOW_VLLM_PYTHON", str(tmp_path / "none" / "python"))
    monkeypatch.setattr(pv, "cpu_flags", lambda: {"avx2"})
    with pytest.raises(ValueError) as e:
        pv.check_vllm(tiny_cfg(*VLLM_JUDGE, "trainer.device=cpu"), ValueError)
    assert str(e.value).startswith("reward.judge.engine=vllm needs the vLLM runtime") and "make setup-vllm" in str(e.value)
    pv.check_vllm(tiny_cfg(*ON, "trainer.device=cpu"), ValueError)  # an hf judge and hf rollouts: nothing asked


def test_preflight_sizes_the_judge_kv_cache_for_the_judges_whole_context(monkeypatch, tmp_path):
    import flows.preflight_vllm as pv

    monkeypatch.setenv("HYBRIDFLOW_VLLM_PYTHON", str(tmp_path / "none" / "python"))
    monkeypatch.setattr(pv, "cpu_flags", lambda: {"avx2"})
    # tiny, hidden 16, 4 heads of 4 (2 KV heads), 1 layer, float32: 2 (K, V) × 1 × 2 × 4 × 4 B = 64 B a
    # token; the tiny judge's context is 512 tokens → 32768 B = 3.05e-05 GiB; 1e-5 GiB holds 167 tokens
    cfg = tiny_cfg(*VLLM_JUDGE, "reward.judge.kv_cache_gib=0.00001", "trainer.device=cpu")
    with pytest.raises(ValueError, match=r"^reward.judge.kv_cache_gib=1e-05 holds less than one sequence of 512 tokens "
                                         r"\(3.05e-05 GiB in float32\); raise it or use a judge with a shorter context$"):
        pv.check_vllm(cfg, ValueError)
    small = tiny_cfg(*VLLM_JUDGE, "rollout.kv_cache_gib=0.00001", "trainer.device=cpu")  # the judge's default
    assert "rollout.kv_cache_gib (the judge's)=1e-05" in pv.judge_kv_cache_problem(
        small, pv._model_config(small.judge_model), 1 << 34)
    assert pv.judge_kv_cache_problem(tiny_cfg(*VLLM_JUDGE), pv._model_config(cfg.judge_model), 1 << 34) is None


# ---- the worker on a stand-in vLLM --------------------------------------------------------------------
VERDICTS = ["Score: 3", "no idea", "Score: 4"]


class JudgeLLM(FakeLLM):
    """A stand-in ``vllm.LLM`` that answers prompt i with VERDICTS[i] (judge tokens) + its first stop
    token, and reports a max_model_len of its own (vLLM may lower the one asked for)."""

    tokenizer = None

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.model_config = types.SimpleNamespace(max_model_len=200)

    def generate(self, prompts, sampling_params, use_tqdm=True, lora_request=None):
        self.calls.append(("generate", prompts, sampling_params))
        outs = []
        for i, (p, sp) in enumerate(zip(prompts, sampling_params, strict=True)):
            ids = self.tokenizer(VERDICTS[i], add_special_tokens=False).input_ids + [sp.stop_token_ids[0]]
            outs.append(RequestOutput(str(i), None, p["prompt_token_ids"], None,
                                      [completion(0, ids, [-1.0] * len(ids), "stop")]))
        return outs


def test_the_judge_worker_on_vllm_scores_verdicts_and_never_loads_a_torch_module(fake_vllm):  # noqa: F811
    from hybridflow.models import load_causal_lm
    from workers.judge import JudgeWorker
    from workers.rollout.vllm import VLLMRolloutEngine

    fake_vllm.LLM, fake_vllm.sleep_mode = JudgeLLM, False
    cfg = tiny_cfg(*VLLM_JUDGE, f"reward.judge.rubric={json.dumps(RUBRIC)}", "reward.judge.max_score=4",
                   "reward.judge.max_new_tokens=8", "reward.judge.micro_batch_trajectories=3",
                   "reward.judge.kv_cache_gib=0.125", "trainer.seed=5")
    JudgeLLM.tokenizer = None
    worker = JudgeWorker(cfg)
    JudgeLLM.tokenizer = worker.tokenizer
    assert isinstance(worker.engine, VLLMRolloutEngine) and worker.module is None
    kw = worker.engine.llm.kwargs
    assert (kw["dtype"], kw["seed"], kw["tensor_parallel_size"], kw["max_num_seqs"]) == ("float32", 5, 1, 3)
    assert kw["max_model_len"] == 512 and kw["kv_cache_memory_bytes"] == 1 << 27  # the tiny context; 0.125 GiB
    assert not kw.get("enable_lora")
    assert worker.context == 200  # fits() reads vLLM's resolved max_model_len
    # the folder vLLM loads is the initial policy of seed 5, what the hf judge loads
    folder = load_file(str(Path(kw["model"]) / "model.safetensors"))
    policy = load_causal_lm(cfg.model, seed=5).state_dict()
    assert all(torch.equal(folder[n], policy[n]) for n in folder) and len(folder) >= len(policy) - 1

    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    batch = response_batch(worker.policy_tokenizer, RESPONSES, TRUTHS, 40, raw_chat=chats)
    out = worker.judge_responses(batch, seed=11)
    assert out.non_tensors["judge_score"] == [0.75, None, 1.0]  # 3/4, unparsed, 4/4
    assert out.non_tensors["judge_failure"] == [None, "unparsed", None]
    assert out.non_tensors["judge_verdict"] == VERDICTS
    (_, prompts, params), = [c for c in worker.engine.llm.calls if c[0] == "generate"]
    assert [p["prompt_token_ids"] for p in prompts] == worker._prompt_rows(batch)
    assert {(p.temperature, p.max_tokens, tuple(p.stop_token_ids), p.n) for p in params} == {
        (0.0, 8, tuple(worker.stop_ids), 1)}
    assert out.meta["metrics"]["reward/judge_unparsed"] == 1.0 and out.meta["metrics"]["judge/tokens_per_s"] > 0


def test_rows_over_the_vllm_judges_context_are_not_sent(fake_vllm):  # noqa: F811
    from workers.judge import JudgeWorker

    fake_vllm.LLM, fake_vllm.sleep_mode = JudgeLLM, False
    worker = JudgeWorker(tiny_cfg(*VLLM_JUDGE, f"reward.judge.rubric={json.dumps(RUBRIC)}",
                                  "reward.judge.max_new_tokens=8"))
    JudgeLLM.tokenizer = worker.tokenizer
    long = "9" * 300  # 300 judge tokens: over vLLM's 200, though under the model's 512
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    batch = response_batch(worker.policy_tokenizer, [RESPONSES[0], long, RESPONSES[2]], TRUTHS, 310, raw_chat=chats)
    out = worker.judge_responses(batch, seed=0)
    assert out.non_tensors["judge_failure"] == [None, "overlong", "unparsed"]  # rows 0 and 2 got verdicts 0 and 1
    (_, prompts, _), = [c for c in worker.engine.llm.calls if c[0] == "generate"]
    assert len(prompts) == 2 and out.meta["metrics"]["reward/judge_overlong"] == 1.0
