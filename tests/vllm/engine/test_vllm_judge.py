"""The judge on a real vLLM (``reward.judge.engine: vllm``), inside the vLLM runtime (``make test-vllm``):
its greedy verdicts equal the hf judge's for the same rows, token for token (float32, the tiny Llama of
hidden 128 as the initial policy of the same seed on both sides), and repeat exactly."""

from __future__ import annotations

import json

import vllm  # noqa: F401  (this file runs inside the vLLM runtime: make test-vllm)

from tests.unit._worker_helpers import response_batch, tiny_cfg
from workers.judge import JudgeWorker

RUBRIC = "Q: {prompt}\nA: {response}\nScore 0-9:"
QUESTIONS = ["1+1=", "22+3=", "7*6=", "what is 9-4?"]
RESPONSES = ["\\boxed{2}", "24", "x=42", "five"]
TRUTHS = ["2", "25", "42", "5"]
JUDGE = ["model.tiny_hidden_size=128", "model.tiny_layers=2", "model.precision=fp32", "trainer.seed=3",
         "reward.judge.enable=true", "placement.pools.judge={workers: 1, cpus_per_worker: 0.5, roles: [judge]}",
         f"reward.judge.rubric={json.dumps(RUBRIC)}", "reward.judge.max_new_tokens=12",
         "reward.judge.micro_batch_trajectories=4"]


def _batch(worker: JudgeWorker):
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    return response_batch(worker.policy_tokenizer, RESPONSES, TRUTHS, 16, raw_chat=chats,
                          uid=[f"u{i}" for i in range(len(QUESTIONS))])


def test_vllm_judge_verdicts_equal_the_hf_judges_and_repeat():
    hf = JudgeWorker(tiny_cfg(*JUDGE))
    vl = JudgeWorker(tiny_cfg(*JUDGE, "reward.judge.engine=vllm", "reward.judge.kv_cache_gib=0.125"))
    assert hf.module is not None and vl.module is None
    assert vl.context == hf.context == 512  # vLLM's max_model_len: the tiny model's context
    assert vl._prompt_rows(_batch(vl)) == hf._prompt_rows(_batch(hf))
    expected = hf.judge_responses(_batch(hf), seed=0).non_tensors["judge_verdict"]
    first = vl.judge_responses(_batch(vl), seed=0)
    again = vl.judge_responses(_batch(vl), seed=123)  # greedy: the seed does not matter
    assert first.non_tensors["judge_verdict"] == expected, (first.non_tensors["judge_verdict"], expected)
    assert again.non_tensors["judge_verdict"] == expected
    assert any(v for v in expected)  # the random judge writes something: a comparison of empty strings proves nothing
    assert first.meta["metrics"]["judge/tokens_per_s"] > 0
    # the same verdict tokens, not just the same text (special tokens are dropped from the text)
    rows = hf._prompt_rows(_batch(hf))
    h_texts, h_lengths, _ = hf._generate(rows, 0)
    v_texts, v_lengths, _ = vl._generate(rows, 0)
    assert (v_texts, v_lengths) == (h_texts, h_lengths)
