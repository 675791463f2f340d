"""The judge reward (``reward.judge``): verdict parsing and rubric rendering (pure), the config's
checks, JudgeWorker on the tiny random model, and the reward worker's combination of its scores.

Expected values are worked out by hand in each test; the worker's judge prompts are written out
in the tiny ChatML template by hand."""

from __future__ import annotations

import json
import typing

import pytest
import torch

from hybridflow.config import ConfigError
from hybridflow.config.reward import JudgeVerdict
from hybridflow.registry import UnknownNameError
from hybridflow.rewards.judge import (
    judge_rule_agreement,
    judge_score,
    parse_score_line,
    parse_score_tag,
    render_rubric,
    verdict_parser_names,
)
from tests.unit._worker_helpers import response_batch, tiny_cfg
from workers.rollout.base import RolloutOutput

JUDGE_POOL = "placement.pools.judge={workers: 1, cpus_per_worker: 0.5, roles: [judge]}"
ON = ("reward.judge.enable=true", JUDGE_POOL)
RUBRIC = "Q: {prompt}\nA: {response}\nTruth: {ground_truth}\nScore: 0-4"


# ---- (1) parsing and rendering, pure ------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is fine.\nScore: 7", 7.0),
        ("score = 3/5", 3.0),
        ("**Score:** 8\nthen Score: 9", 9.0),  # the last one counts
        ("Score: 2.5", 2.5),
        ("Score: -1", -1.0),  # parsed; the range check is judge_score's
        ("seven out of ten", None),
        ("Score:", None),
    ],
)
def test_score_line_by_hand(text, expected):
    assert parse_score_line(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<score>4</score>", 4.0),
        ("<SCORE> 1 </score> and <score>0</score>", 0.0),
        ("<score>four</score>", None),
        ("Score: 3", None),
    ],
)
def test_score_tag_by_hand(text, expected):
    assert parse_score_tag(text) == expected


def test_the_config_names_exactly_the_registered_parsers():
    assert sorted(typing.get_args(JudgeVerdict)) == verdict_parser_names()


def test_judge_score_is_n_over_max_and_none_out_of_range():
    assert judge_score("Score: 7", "score_line", 10) == pytest.approx(0.7)
    assert judge_score("<score>1</score>", "score_tag", 4) == pytest.approx(0.25)
    assert judge_score("Score: 10", "score_line", 10) == 1.0  # the top is in range
    assert judge_score("Score: 11", "score_line", 10) is None
    assert judge_score("Score: -1", "score_line", 10) is None
    assert judge_score("no verdict", "score_line", 10) is None
    with pytest.raises(UnknownNameError, match="known: score_line, score_tag"):
        judge_score("Score: 1", "stars", 10)


def test_render_rubric_substitutes_once_and_keeps_other_braces():
    out = render_rubric(
        "{prompt} | {response} | {ground_truth} | \\boxed{}", "1+1", "I say {ground_truth}", "2"
    )
    assert (
        out == "1+1 | I say {ground_truth} | 2 | \\boxed{}"
    )  # the response's placeholder is text, not the truth
    assert render_rubric("[{ground_truth}]", "", "", None) == "[]"


def test_agreement_by_hand():
    # rows 0, 1, 3 scored (row 2 unparsed): pass/pass agree, fail/pass disagree, pass/fail disagree → 1/3
    assert judge_rule_agreement([0.9, 0.2, None, 0.6], [1.0, 1.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    # 0.5 passes, a rule score 0 fails: both rows agree
    assert judge_rule_agreement([0.5, 0.0], [0.1, 0.0]) == 1.0
    assert judge_rule_agreement([None, None], [1.0, 0.0]) is None


# ---- (2) config: one line before anything starts --------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (("reward.judge.rubric=Rate {response}", *ON), "reward.judge.rubric lacks {prompt}"),
        (("reward.judge.enable=true",), "reward.judge.enable=true needs a pool with role 'judge'"),
        ((JUDGE_POOL,), "role 'judge' but reward.judge.enable is false"),
        (("reward.judge.combine=replace",), "reward.judge.combine='replace' needs reward.judge.enable=true"),
        (("reward.judge.weight=0", *ON), "reward.judge.weight=0 with reward.judge.enable=true"),
        (
            ("reward.judge.combine=replace", "reward.model.path=tiny", *ON),
            "reward.model.path is set but reward.judge",
        ),
        (
            ("reward.judge.combine=replace", "reward.function=m:f", *ON),
            "reward.function='m:f' is never called",
        ),
        (("reward.judge.verdict=stars", *ON), "reward.judge.verdict"),
    ],
)
def test_bad_judge_config_names_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace("{", r"\{").replace("}", r"\}")):
        tiny_cfg(*overrides)


def test_the_judge_model_is_the_initial_policy_unless_a_path_is_given():
    cfg = tiny_cfg(*ON, "model.tokenizer_path=tiny", "model.lora_rank=4")
    assert (cfg.judge_model.path, cfg.judge_model.tokenizer_path, cfg.judge_model.lora_rank) == (
        "tiny",
        "tiny",
        0,
    )
    own = tiny_cfg(*ON, "reward.judge.path=/models/judge", "model.tokenizer_path=tiny")
    assert (own.judge_model.path, own.judge_model.tokenizer_path) == ("/models/judge", None)


def test_the_dataflow_has_a_judge_node_only_when_configured():
    from flows.iteration import builtin_dataflow

    with_judge = builtin_dataflow(tiny_cfg(*ON))
    names = [n.name for n in with_judge.nodes]
    assert names.index("judge") < names.index("reward")
    assert with_judge.deps("reward") == ["rollout", "judge"] and with_judge.deps("judge") == ["rollout"]
    assert "judge" not in [n.name for n in builtin_dataflow(tiny_cfg()).nodes]


def test_preflight_refuses_a_rubric_that_cannot_fit_even_empty(tmp_path):
    from flows.preflight import PreflightError, check_judge

    check_judge(tiny_cfg(*ON))  # the default rubric fits the tiny model's 512 positions
    long = "x" * 500 + " {prompt} {response}"  # the tiny tokenizer: one token per character
    with pytest.raises(
        PreflightError,
        match=r"reward\.judge\.rubric is \d+ judge tokens .* exceed the judge's context"
        r" \(512 positions, model\.path='tiny'\)",
    ):
        check_judge(tiny_cfg(*ON, f"reward.judge.rubric={long}", "reward.judge.max_new_tokens=8"))


def test_preflight_names_a_missing_judge_model(tmp_path):
    from flows.preflight import PreflightError, check_models

    with pytest.raises(PreflightError, match="reward.judge.path='/nowhere/judge'"):
        check_models(tiny_cfg(*ON, "reward.judge.path=/nowhere/judge"))


# ---- (3) JudgeWorker on the tiny model ------------------------------------------------------------
QUESTIONS = ["1+1=", "22+3=", "7*6="]
RESPONSES = ["\\boxed{2}", "24", "x=42"]  # arith truths 2, 25, 42 → rule scores 1, 0, 1
TRUTHS = ["2", "25", "42"]


def _chatml_user(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


class _FixedVerdicts:
    """An engine that answers each prompt row with the next of ``verdicts`` and records what it got."""

    device = torch.device("cpu")

    def __init__(self, tokenizer, verdicts: list[str]):
        self.tokenizer, self.verdicts, self.prompts = tokenizer, list(verdicts), []

    def generate(self, prompt_ids, prompt_mask, sampling):
        self.prompts += [ids[m].tolist() for ids, m in zip(prompt_ids, prompt_mask, strict=True)]
        eos = self.tokenizer.eos_token_id
        rows = [
            self.tokenizer(self.verdicts.pop(0), add_special_tokens=False).input_ids + [eos]
            for _ in range(len(prompt_ids))
        ]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), eos, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), True
        return RolloutOutput(ids, mask, torch.zeros(ids.shape), ["stop"] * len(rows))


@pytest.fixture(scope="module")
def judge_worker():
    from workers.judge import JudgeWorker

    # an override's value is YAML: a rubric with ': ' and braces is written as a quoted string
    return JudgeWorker(
        tiny_cfg(
            *ON,
            f"reward.judge.rubric={json.dumps(RUBRIC)}",
            "reward.judge.max_score=4",
            "reward.judge.max_new_tokens=8",
        )
    )


def _rows(worker, questions=QUESTIONS, responses=RESPONSES):
    chats = [[{"role": "user", "content": q}] for q in questions]
    return response_batch(
        worker.policy_tokenizer, list(responses), TRUTHS[: len(responses)], 40, raw_chat=chats
    )


def test_verdicts_become_scores_and_failures_by_hand(judge_worker):
    w = judge_worker
    real = w.engine
    w.engine = fake = _FixedVerdicts(w.tokenizer, ["Score: 3", "it is wrong", "Score: 9"])
    try:
        out = w.judge_responses(_rows(w), seed=0)
    finally:
        w.engine = real
    # 3/4; no "Score:" → unparsed; 9 > max_score 4 → unparsed
    assert out["judge_score"] == [0.75, None, None]
    assert out["judge_failure"] == [None, "unparsed", "unparsed"]
    assert out["judge_verdict"] == ["Score: 3", "it is wrong", "Score: 9"]
    # each judge prompt is the rubric rendered with the row, as one user turn of the ChatML template
    expected = [
        _chatml_user(f"Q: {q}\n\nA: {r}\nTruth: {t}\nScore: 0-4")  # chat contents end with "\n"
        for q, r, t in zip(QUESTIONS, RESPONSES, TRUTHS, strict=True)
    ]
    assert [w.tokenizer.decode(p) for p in fake.prompts] == expected
    m = out.meta["metrics"]
    assert (m["reward/judge_unparsed"], m["reward/judge_overlong"]) == (2.0, 0.0)
    assert m["judge/score/mean"] == 0.75
    # verdict tokens: "Score: 3" 8 chars + <|im_end|> = 9; "it is wrong" 11 + 1 = 12; "Score: 9" 9 → 30 / 3
    assert m["judge/verdict_tokens/mean"] == 10.0
    assert m["judge/prompt_tokens/mean"] == sum(len(p) for p in fake.prompts) / 3
    assert m["judge/tokens_per_s"] > m["judge/verdict_tokens_per_s"] > 0
    assert out.meta["logs"] == [
        "judge: 2 of 3 verdicts unparsed (first verdict: 'it is wrong'), 0 over the "
        "judge's context; scored reward.on_error"
    ]


def test_the_verdict_prefix_ends_the_prompt_and_starts_the_verdict(judge_worker):
    w = judge_worker
    real, cfg = w.engine, w.judge_cfg
    w.engine = fake = _FixedVerdicts(w.tokenizer, [" 1", " no"])
    w.judge_cfg = cfg.model_copy(update={"verdict_prefix": "Score:"})
    try:
        out = w.judge_responses(_rows(w, QUESTIONS[:2], RESPONSES[:2]), seed=0)
    finally:
        w.engine, w.judge_cfg = real, cfg
    ending = "<|im_start|>assistant\nScore:"  # the generation prompt, then the prefix
    assert [w.tokenizer.decode(p)[-len(ending) :] for p in fake.prompts] == [ending, ending]
    assert out["judge_verdict"] == ["Score: 1", "Score: no"]
    assert out["judge_score"] == [0.25, None]  # 1 / max_score 4; "no" is not a number


def test_a_row_over_the_judge_context_is_counted_not_generated(judge_worker):
    w = judge_worker
    real = w.engine
    w.engine = fake = _FixedVerdicts(w.tokenizer, ["Score: 4", "Score: 0"])
    long_question = "9" * 480  # + rubric + template + 8 new tokens > 512 positions
    try:
        out = w.judge_responses(_rows(w, [QUESTIONS[0], long_question, QUESTIONS[2]]), seed=0)
    finally:
        w.engine = real
    assert len(fake.prompts) == 2 and all(len(p) + 8 <= 512 for p in fake.prompts)
    assert out["judge_score"] == [1.0, None, 0.0]
    assert out["judge_failure"] == [None, "overlong", None]
    assert out["judge_verdict"][1] == ""
    m = out.meta["metrics"]
    assert (m["reward/judge_unparsed"], m["reward/judge_overlong"]) == (0.0, 1.0)
    assert m["judge/score/mean"] == 0.5


def test_the_tiny_judge_generates_greedily_and_is_the_frozen_initial_policy(judge_worker):
    from hybridflow.models import load_causal_lm
    from hybridflow.rewards.judge import judge_score as score_of

    w = judge_worker
    first = w.judge_responses(_rows(w), seed=0)
    again = w.judge_responses(_rows(w), seed=123)  # temperature 0: the seed does not matter
    assert first["judge_verdict"] == again["judge_verdict"]
    assert all(0 < len(w.tokenizer(v).input_ids) <= 8 for v in first["judge_verdict"])
    # each row's score is the parser's reading of its verdict (random text: mostly unparsed)
    assert first["judge_score"] == [score_of(v, "score_line", 4) for v in first["judge_verdict"]]
    unparsed = sum(s is None for s in first["judge_score"])
    assert first.meta["metrics"]["reward/judge_unparsed"] == unparsed
    # the judge's weights are the initial policy's (same model, same seed), frozen
    initial = load_causal_lm(w.cfg.model, seed=w.cfg.trainer.seed)
    for (name, a), (_, b) in zip(w.module.state_dict().items(), initial.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert not any(p.requires_grad for p in w.module.parameters())


# ---- (4) the reward worker combines the judge's scores ---------------------------------------------
def _judged(worker, judge_scores):
    batch = response_batch(worker.tokenizer, RESPONSES, TRUTHS, 12, raw_prompt=QUESTIONS)
    batch.set("judge_score", judge_scores)
    return batch


def test_add_combines_judge_with_rule_and_unparsed_rows_are_on_error_not_failures():
    from tasks.reward import reward_result
    from workers.reward import RewardWorker

    w = RewardWorker(tiny_cfg(*ON, "reward.judge.weight=2", "reward.on_error=-1"))
    try:
        out = w.compute_rewards(_judged(w, [0.2, None, 1.0]))
    finally:
        w.close()
    # rule scores [1, 0, 1]; final = rule + 2·judge, the unparsed row's judge score is on_error -1:
    # [1 + 0.4, 0 + 2·(-1), 1 + 2·1] = [1.4, -2, 3]
    assert out["score"] == pytest.approx([1.4, -2.0, 3.0])
    assert out["reward_failure"] == [None, None, None]
    assert reward_result(out).failed_rows == 0  # the judge's unparsed row does not count toward stopping
    # agreement over the judge-scored rows 0 and 2: 0.2 fails vs rule 1 passes; 1.0 passes vs 1 → 1/2
    assert out.meta["metrics"]["reward/judge_rule_agreement"] == 0.5
    assert out.meta["metrics"]["critic/score/mean"] == pytest.approx((1.4 - 2.0 + 3.0) / 3)


def test_replace_scores_by_the_judge_alone_and_skips_the_rules():
    from workers.reward import RewardWorker

    w = RewardWorker(
        tiny_cfg(*ON, "reward.judge.combine=replace", "reward.judge.weight=2", "reward.on_error=-1")
    )
    try:
        out = w.compute_rewards(_judged(w, [0.2, None, 1.0]))
    finally:
        w.close()
    assert out["score"] == pytest.approx([0.4, -2.0, 2.0])  # 2·judge, rules not called
    assert "acc" not in out and "reward/judge_rule_agreement" not in out.meta["metrics"]
