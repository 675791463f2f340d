"""The multi-turn rollout loop (workers/rollout/multi_turn.py) with a scripted engine: exact ids
and masks per turn, limits, failing tools and environments; then the hf engine on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from hybridflow.agents.remote import EnvRunner
from hybridflow.batch import Batch
from hybridflow.config import config_from_dict
from hybridflow.models import build_tiny_model, build_tiny_tokenizer
from tests.unit.test_rollout_vllm import fake_vllm  # noqa: F401 - the vllm stand-in fixture
from workers.rollout.base import RolloutOutput, SamplingParams
from workers.rollout.multi_turn import TRUNCATION_MARKER, MultiTurnRollout

TOK = build_tiny_tokenizer()
EOS = TOK.eos_token_id  # <|im_end|>
NL = TOK.convert_tokens_to_ids("\n")
FIX = "tests.unit.agent_fixtures"


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def call(name: str, **args) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


class ScriptedEngine:
    """Returns fixed turns: row whose text contains ``key`` gets ``script[key][k]`` at its k-th
    assistant turn (k = assistant headers in the row - 1), then EOS. Log-prob of token j: -(j+1)/100."""

    def __init__(self, script: dict[str, list[str]]) -> None:
        self.script, self.calls = script, []

    def generate(self, prompt_ids, prompt_mask, sampling: SamplingParams) -> RolloutOutput:
        rows = []
        for row, m in zip(prompt_ids, prompt_mask, strict=True):
            text = TOK.decode(row[m].tolist())
            key = next(k for k in self.script if k in text)
            turn = text.count("<|im_start|>assistant") - 1
            rows.append([*ids(self.script[key][turn]), EOS][: sampling.max_new_tokens])
        self.calls.append(len(rows))
        width = max(len(r) for r in rows)
        out_ids = torch.full((len(rows), width), EOS, dtype=torch.int64)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, r in enumerate(rows):
            out_ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), True
        lp = -(torch.arange(width, dtype=torch.float32) + 1).expand(len(rows), width) / 100 * mask
        reasons = ["stop" if r[-1] == EOS else "length" for r in rows]
        return RolloutOutput(out_ids, mask, lp.contiguous(), reasons)


@pytest.fixture(scope="module")
def runner():
    r = EnvRunner(num_workers=2, timeout_s=3.0)
    yield r
    r.close()


def batch_of(questions: list[str], extra: list[dict] | None = None) -> Batch:
    chats = [[{"role": "user", "content": q}] for q in questions]
    enc = [ids(TOK.apply_chat_template(c, add_generation_prompt=True, tokenize=False)) for c in chats]
    width = max(len(e) for e in enc)
    p_ids = torch.full((len(enc), width), EOS, dtype=torch.int64)
    p_mask = torch.zeros((len(enc), width), dtype=torch.bool)
    for i, e in enumerate(enc):
        p_ids[i, width - len(e) :], p_mask[i, width - len(e) :] = torch.tensor(e), True
    nt = {"uid": [f"u{i}" for i in range(len(chats))], "raw_chat": chats, "data_source": ["t"] * len(chats),
          "ground_truth": ["5"] * len(chats), "extra_info": extra or [{} for _ in chats]}
    return Batch.from_dict({"prompt_ids": p_ids, "prompt_mask": p_mask}, nt)


def rollout(runner, engine, rollout_cfg: dict, questions, extra=None, n=1):
    cfg = config_from_dict({"rollout": rollout_cfg}).rollout
    loop = MultiTurnRollout(engine, TOK, cfg, runner)
    return loop.generate(batch_of(questions, extra), SamplingParams(max_new_tokens=cfg.max_response_tokens, n=n))


def segments(mask: list[bool]) -> list[tuple[bool, int]]:
    out: list[tuple[bool, int]] = []
    for m in mask:
        if out and out[-1][0] == m:
            out[-1] = (m, out[-1][1] + 1)
        else:
            out.append((m, 1))
    return out


TOOLS = {"tools": [f"{FIX}:add", f"{FIX}:boom", f"{FIX}:hang", f"{FIX}:die", "calculator"], "max_response_tokens": 400}


def test_exact_ids_and_masks_prompt_turn_observation_turn(runner):
    t1, t2 = call("add", a=2, b=3), "It is 5."
    out = rollout(runner, ScriptedEngine({"Q1": [t1, t2]}), TOOLS, ["Q1"])
    observation = ids("\n") + ids("<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")  # ids() maps specials
    expected = [*ids(t1), EOS, *observation, *ids(t2), EOS]
    n = len(expected)
    assert out.response_ids[0, :n].tolist() == expected
    assert out.response_mask[0, :n].tolist() == [True] * (len(ids(t1)) + 1) + [False] * len(observation) + \
        [True] * (len(ids(t2)) + 1)
    assert out.observation_mask[0, :n].tolist() == [not m for m in out.response_mask[0, :n].tolist()]
    assert not out.response_mask[0, n:].any() and not out.observation_mask[0, n:].any()
    # model tokens keep the engine's log-probs, observation positions hold 0
    lp = out.rollout_log_probs[0]
    assert lp[: len(ids(t1)) + 1].tolist() == pytest.approx([-(j + 1) / 100 for j in range(len(ids(t1)) + 1)])
    assert lp[len(ids(t1)) + 1 : len(ids(t1)) + 1 + len(observation)].abs().sum() == 0
    assert out.finish_reason == ["stop"] and out.non_tensors["num_turns"] == [2]
    assert out.metrics["tool/calls/mean"] == 1 and out.metrics["tool/add/calls"] == 1
    # the prompt now carries the tool schemas (the tiny template takes no tools=: a system message)
    prompt = TOK.decode(out.prompt_ids[0][out.prompt_mask[0]].tolist())
    assert prompt.startswith("<|im_start|>system\nYou may call functions.") and '"name": "add"' in prompt
    assert prompt.endswith("<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n")
    assert out.non_tensors["messages"][0][-3:] == [
        {"role": "assistant", "content": t1}, {"role": "tool", "name": "add", "content": "5"},
        {"role": "assistant", "content": t2}]


def test_rows_at_different_turns_share_engine_calls(runner):
    engine = ScriptedEngine({"QA": ["done"], "QB": [call("add", a=1, b=1), call("add", a=2, b=2), "4"]})
    out = rollout(runner, engine, TOOLS, ["QA", "QB"])
    assert engine.calls == [2, 1, 1]  # QA leaves after its first turn
    assert out.non_tensors["num_turns"] == [1, 3] and out.finish_reason == ["stop", "stop"]


def test_progress_counts_finished_trajectories_after_each_round(runner):
    engine = ScriptedEngine({"QA": ["done"], "QB": [call("add", a=1, b=1), call("add", a=2, b=2), "4"]})
    cfg = config_from_dict({"rollout": TOOLS}).rollout
    seen = []
    MultiTurnRollout(engine, TOK, cfg, runner).generate(batch_of(["QA", "QB"]), SamplingParams(
        max_new_tokens=cfg.max_response_tokens), progress=lambda done, total: seen.append((done, total)))
    assert seen == [(1, 2), (1, 2), (2, 2)]  # QA ends in round 1, QB in round 3


def test_observation_is_truncated_in_the_middle(runner):
    cfg = {**TOOLS, "multi_turn": {"max_observation_tokens": 40}}
    out = rollout(runner, ScriptedEngine({"Q": [call("calculator", expression="10 ** 60"), "ok"]}), cfg, ["Q"])
    segs = segments(out.response_mask[0].tolist())
    first_obs = segs[1]
    assert first_obs == (False, 1 + 40)  # the "\n" closing the turn, then 40 observation tokens
    start = segs[0][1] + 1
    obs = out.response_ids[0, start : start + 40].tolist()
    assert TRUNCATION_MARKER in TOK.decode(obs) and TOK.decode(obs).endswith("<|im_start|>assistant\n")


def test_max_turns_ends_the_trajectory(runner):
    cfg = {**TOOLS, "multi_turn": {"max_turns": 2}}
    out = rollout(runner, ScriptedEngine({"Q": [call("add", a=1, b=1)] * 5}), cfg, ["Q"])
    assert out.finish_reason == ["max_turns"] and out.non_tensors["num_turns"] == [2]
    real = out.response_mask[0] | out.observation_mask[0]
    assert bool(out.response_mask[0, int(real.nonzero()[-1])])  # it ends on the model's turn: no observation after


def test_tools_that_raise_hang_or_exit_give_error_observations(runner):
    script = {"QR": [call("boom", x=1), "a"], "QH": [call("hang", x=1), "b"], "QX": [call("die", x=1), "c"]}
    out = rollout(runner, ScriptedEngine(script), TOOLS, ["QR", "QH", "QX"])
    assert out.finish_reason == ["stop"] * 3 and out.non_tensors["num_turns"] == [2, 2, 2]
    obs = [m[-2]["content"] for m in out.non_tensors["messages"]]
    assert "boom raised RuntimeError: boom" in obs[0]
    assert obs[1].startswith("error: the tool call failed (still running") and "3 s" in obs[1]
    assert obs[2].startswith("error: the tool call failed (worker process died")
    assert out.metrics["tool/errors"] == 2 and out.metrics["tool/timeouts"] == 1
    after = rollout(runner, ScriptedEngine({"Q": [call("add", a=1, b=2), "3"]}), TOOLS, ["Q"])
    assert after.non_tensors["messages"][0][-2]["content"] == "3"  # the pool replaced its workers


def test_malformed_call_is_a_parse_error_observation(runner):
    out = rollout(runner, ScriptedEngine({"Q": ['<tool_call>{"name": "add", </tool_call>', "x"]}), TOOLS, ["Q"])
    assert out.non_tensors["messages"][0][-2]["content"].startswith("could not parse the tool call: not valid JSON")
    assert out.metrics["tool/parse_errors"] == 1 and out.finish_reason == ["stop"]


def test_turn_budget_appends_end_of_turn_and_the_environment_still_steps(runner):
    long_call = call("add", a=1, b=2)
    cap = len(ids(long_call)) + 3
    cfg = {**TOOLS, "multi_turn": {"max_tokens_per_turn": cap}}
    out = rollout(runner, ScriptedEngine({"Q": [long_call + " and now some more words", "3"]}), cfg, ["Q"])
    segs = segments(out.response_mask[0].tolist())
    assert segs[0] == (True, cap)  # cut at the turn budget, no EOS sampled
    start = cap
    assert out.response_ids[0, start : start + 2].tolist() == [EOS, NL]  # end-of-turn, not the model's
    assert out.non_tensors["messages"][0][-2]["content"] == "3" and out.finish_reason == ["stop"]


def test_whole_budget_ends_with_length(runner):
    cfg = {**TOOLS, "max_response_tokens": 80}
    out = rollout(runner, ScriptedEngine({"Q": [call("add", a=1, b=1)] * 5}), cfg, ["Q"])
    assert out.finish_reason == ["length"] and out.response_ids.shape[1] <= 80


def test_environment_rewards_done_and_kwargs(runner):
    cfg = {"environment": f"{FIX}:GuessEnv", "max_response_tokens": 200}
    out = rollout(runner, ScriptedEngine({"Q": ["3", "9", "7"]}), cfg, ["Q"], extra=[{"env_kwargs": {"target": 7}}])
    assert out.finish_reason == ["env_done"] and out.non_tensors["num_turns"] == [3]
    assert out.non_tensors["env_reward"] == [pytest.approx(-0.1 - 0.1 + 1.0)]
    msgs = out.non_tensors["messages"][0]
    assert [m["content"] for m in msgs if m["role"] == "user"][1:] == ["higher", "lower"]


def test_async_environment_with_its_own_start_and_agent_name(runner):
    cfg = {"environment": f"{FIX}:GuessEnv", "max_response_tokens": 200, "multi_turn": {"max_turns": 2}}
    extra = [{"agent_name": f"{FIX}:AsyncEchoEnv"}, {"agent_name": f"{FIX}:BrokenEnv"}]
    out = rollout(runner, ScriptedEngine({"echo": ["hello", "again"], "QB": ["x"]}), cfg, ["QE", "QB"], extra=extra)
    assert TOK.decode(out.prompt_ids[0][out.prompt_mask[0]].tolist()) == \
        "<|im_start|>user\necho<|im_end|>\n<|im_start|>assistant\n"
    assert out.finish_reason == ["max_turns", "env_error"]
    assert out.non_tensors["env_reward"][0] == pytest.approx(1.0) and out.metrics["env/errors"] == 1


def test_python_block_format(runner):
    cfg = {"tools": ["python"], "multi_turn": {"tool_format": "python"}, "max_response_tokens": 300}
    out = rollout(runner, ScriptedEngine({"Q": ["```python\nprint(123 * 45)\n```", "5535"]}), cfg, ["Q"])
    assert out.non_tensors["messages"][0][-2] == {"role": "tool", "name": "python", "content": "5535\n"}
    prompt = TOK.decode(out.prompt_ids[0][out.prompt_mask[0]].tolist())
    assert prompt == "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"  # no schema for this format
    cfg["multi_turn"]["system_prompt"] = "Use ```python blocks."
    out = rollout(runner, ScriptedEngine({"Q": ["5535"]}), cfg, ["Q"])
    prompt = TOK.decode(out.prompt_ids[0][out.prompt_mask[0]].tolist())
    assert prompt == "<|im_start|>system\nUse ```python blocks.<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"


# ---- the hf engine on a tiny random model --------------------------------------------------------
@pytest.fixture(scope="module")
def hf_rollout(runner):
    from workers.rollout.hf import HFRolloutEngine

    torch.manual_seed(0)
    model = build_tiny_model(len(TOK), hidden_size=32, layers=2, seed=0).eval()
    cfg = {"environment": f"{FIX}:AsyncEchoEnv", "max_response_tokens": 120,
           "multi_turn": {"max_turns": 3, "max_tokens_per_turn": 10}}
    engine = HFRolloutEngine(model, TOK)
    loop = MultiTurnRollout(engine, TOK, config_from_dict({"rollout": cfg}).rollout, runner)
    out = loop.generate(batch_of(["A", "B"]), SamplingParams(max_new_tokens=120, n=2, seed=3, stop_token_ids=(EOS,)))
    batch = Batch.from_dict({k: out.tensors()[k] for k in
                             ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "observation_mask")})
    return model, out, batch


def test_hf_rollout_log_probs_equal_recomputed_on_model_tokens(hf_rollout):
    from workers.log_probs import sequence_log_probs

    model, out, batch = hf_rollout
    assert max(out.non_tensors["num_turns"]) == 3 and out.observation_mask.any()  # really multi-turn
    with torch.no_grad():
        lp, _ = sequence_log_probs(model, batch, temperature=1.0)
    mask = out.response_mask
    diff = (lp.cpu() - out.rollout_log_probs).abs()[mask]
    assert float(diff.max()) < 1e-4
    # without the observation tokens in the attention the recomputation would differ
    blind = Batch.from_dict({k: batch[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")})
    with torch.no_grad():
        lp_blind, _ = sequence_log_probs(model, blind, temperature=1.0)
    assert float((lp_blind.cpu() - out.rollout_log_probs).abs()[mask].max()) > 1e-3


def test_policy_loss_has_no_gradient_at_observation_positions(hf_rollout):
    from hybridflow.algorithms.registry import get_policy_loss
    from workers.log_probs import sequence_log_probs

    model, out, batch = hf_rollout
    lp, _ = sequence_log_probs(model, batch, temperature=1.0)
    lp.retain_grad()
    advantages = torch.linspace(-1, 1, lp.numel()).reshape(lp.shape)
    loss, _ = get_policy_loss("ppo")(lp, lp.detach() + 0.05, advantages, out.response_mask)
    loss.backward()
    assert lp.grad[out.observation_mask].abs().max() == 0
    assert lp.grad[out.response_mask].abs().min() > 0


# ---- the vllm engine (stand-in LLM) drives the same loop with token-id prompts -------------------
@pytest.mark.usefixtures("fake_vllm")
def test_vllm_engine_gets_token_id_prompts_turn_after_turn(runner):
    from tests.unit.test_rollout_vllm import FakeLLM, RequestOutput, completion
    from workers.rollout.vllm import VLLMRolloutEngine

    class ScriptedLLM(FakeLLM):
        """Guesses "3", then "7" (GuessEnv's target), with log-prob -0.5 per token."""

        def generate(self, prompts, sampling_params, use_tqdm=True, lora_request=None):
            self.calls.append(("generate", prompts, sampling_params))
            turn = sum(c[0] == "generate" for c in self.calls) - 1
            toks = [*ids("37"[turn]), EOS]
            return [RequestOutput(str(i), None, p["prompt_token_ids"], None,
                                  [completion(0, toks, [-0.5] * len(toks), "stop", EOS)]) for i, p in enumerate(prompts)]

    llm = ScriptedLLM()
    engine = VLLMRolloutEngine(llm, pad_token_id=EOS, bucket_bytes=1 << 30)
    cfg = {"environment": f"{FIX}:GuessEnv", "max_response_tokens": 100}
    out = rollout(runner, engine, cfg, ["Q"])
    first, second = (c[1][0]["prompt_token_ids"] for c in llm.calls if c[0] == "generate")
    observation = ids("\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n")
    assert second == [*first, *ids("3"), EOS, *observation]  # token in: the first turn's ids, untouched
    assert out.finish_reason == ["env_done"] and out.non_tensors["env_reward"] == [pytest.approx(0.9)]
    n = 2 + len(observation) + 2
    assert out.response_mask[0, :n].tolist() == [True, True] + [False] * len(observation) + [True, True]
    assert out.rollout_log_probs[0, :n][out.response_mask[0, :n]].tolist() == [-0.5] * 4


def test_kv_cache_continuation_equals_prefilling_again(runner, monkeypatch):
    from workers.rollout.hf import HFRolloutEngine

    model = build_tiny_model(len(TOK), hidden_size=32, layers=2, seed=1).eval()
    used = []
    import workers.rollout.hf as hf

    ready = hf.ready_cache
    monkeypatch.setattr(hf, "ready_cache", lambda model, *a: used.append(a[2]) or ready(model, *a))
    outs = {}
    for kv in (True, False):
        cfg = {"environment": f"{FIX}:AsyncEchoEnv", "max_response_tokens": 120,
               "multi_turn": {"max_turns": 3, "max_tokens_per_turn": 10, "kv_cache": kv}}
        loop = MultiTurnRollout(HFRolloutEngine(model, TOK, generation_batch_trajectories=3), TOK,
                                config_from_dict({"rollout": cfg}).rollout, runner)
        outs[kv] = loop.generate(batch_of(["A", "BB"]), SamplingParams(max_new_tokens=120, n=2, seed=5,
                                                                       stop_token_ids=(EOS,)))
    assert used and max(used) > 20  # later turns started from a cache of > 20 positions
    assert torch.equal(outs[True].response_ids, outs[False].response_ids)
    assert torch.equal(outs[True].response_mask, outs[False].response_mask)
    assert torch.allclose(outs[True].rollout_log_probs, outs[False].rollout_log_probs, atol=1e-5)


def test_the_python_tools_own_timeout_counts_in_tool_timeouts(runner):
    """Issue 40: the sandboxed ``python`` tool's own timeout (0.75 x tool_timeout_s) came back as an
    ordinary result and was not counted in tool/timeouts; only the runner's outer timeout was."""
    cfg = {"tools": ["python"], "max_response_tokens": 200,
           "multi_turn": {"tool_timeout_s": 2.0, "sandbox_walls": "optional"}}
    out = rollout(runner, ScriptedEngine({"Q": [call("python", code="while True: pass"), "a"]}), cfg, ["Q"])
    obs = out.non_tensors["messages"][0][-2]["content"]
    assert "[timed out after 1.5 s]" in obs, obs
    assert out.metrics["tool/timeouts"] == 1 and out.metrics["tool/errors"] == 0
