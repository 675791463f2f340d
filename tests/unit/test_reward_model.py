"""The reward model (sequence classification) in RewardWorker, on tiny random models.

Expected scores are computed here independently: the conversation text written out by hand,
tokenized with the reward model's tokenizer, one unpadded row through the model.
"""

from __future__ import annotations

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.config import ConfigError
from hybridflow.models import (
    ModelNotFoundError,
    build_tiny_model,
    build_tiny_reward_model,
    build_tiny_tokenizer,
)
from hybridflow.models.reward_model import pad_rows, truncate_left
from tests.unit._worker_helpers import response_batch, tiny_cfg
from workers.reward import RewardWorker, combine_scores

QUESTIONS = ["1+1=", "22+3=", "7*6="]
RESPONSES = ["\\boxed{2}", "24", "x=42"]  # arith truths 2, 25, 42 → rule scores 1, 0, 1
TRUTHS = ["2", "25", "42"]


def _batch(tokenizer, raw_prompts: list, width: int = 12) -> Batch:
    return response_batch(tokenizer, RESPONSES, TRUTHS, width, raw_prompt=raw_prompts)


def _messages() -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": q}] for q in QUESTIONS]


def _chatml(question: str, response: str) -> str:
    # the tiny ChatML template with the response as the assistant turn, written out by hand
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{response}<|im_end|>\n"


def _logit(model, ids: list[int]) -> float:
    """The reward model's logit for one unpadded row (batch of one: nothing to pool around)."""
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def _last_column(batch: Batch) -> list[int]:
    return (batch["response_mask"].sum(-1) - 1).tolist()


class _SeenIds:
    """Records the input_ids and attention_mask of every reward-model forward."""

    def __init__(self, model):
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, _module, _args, kwargs):
        self.calls.append((kwargs["input_ids"].clone(), kwargs["attention_mask"].clone()))

    def rows(self) -> list[list[int]]:
        return [ids[m.bool()].tolist() for ids, mask in self.calls for ids, m in zip(ids, mask, strict=True)]


def _worker(*overrides: str) -> RewardWorker:
    """A RewardWorker whose random reward model's score head is scaled ×100, so its logits are
    O(1) (a fresh random head gives ~0.01, too close to 0 for the comparisons to mean much)."""
    w = RewardWorker(tiny_cfg(*overrides))
    with torch.no_grad():
        w.reward_model.model.score.weight.mul_(100.0)
    return w


@pytest.fixture(scope="module")
def replace_worker():
    w = _worker("reward.model.path=tiny", "reward.model.combine=replace", "reward.model.weight=2.0",
                "reward.model.micro_batch_trajectories=2")
    yield w
    w.close()


# ---- (1) the score on the last response token is the model's logit on the re-tokenized row --------
def test_rm_score_is_the_logit_of_the_rebuilt_conversation(replace_worker):
    w = replace_worker
    tok = w.reward_model.tokenizer
    out = w.compute_rewards(_batch(w.tokenizer, _messages()))
    expected = [_logit(w.reward_model.model, tok(_chatml(q, r), add_special_tokens=False).input_ids)
                for q, r in zip(QUESTIONS, RESPONSES, strict=True)]
    torch.testing.assert_close(torch.tensor(out["rm_score"]), torch.tensor(expected))
    assert min(abs(a - b) for a, b in [(expected[0], expected[1]), (expected[1], expected[2]),
                                       (expected[0], expected[2])]) > 1e-2  # three rows, three distinct scores
    scores = out["token_level_scores"]
    # "\boxed{2}" is 9 chars + <|im_end|> → column 9; "24" → 2; "x=42" → 4
    assert _last_column(out) == [9, 2, 4]
    for row, col in enumerate([9, 2, 4]):
        torch.testing.assert_close(scores[row, col], torch.tensor(2.0 * expected[row]))  # replace: weight · rm
    assert scores.count_nonzero() == 3
    m = out.meta["metrics"]
    assert m["reward/rm_score/mean"] == pytest.approx(sum(expected) / 3, abs=1e-6)
    assert m["reward/rm_score/max"] == pytest.approx(max(expected), abs=1e-6)
    assert m["reward/rm_score/min"] == pytest.approx(min(expected), abs=1e-6)
    assert m["reward/rm_truncated"] == 0.0
    assert m["critic/score/mean"] == pytest.approx(2.0 * sum(expected) / 3, abs=1e-6)


def test_string_prompt_is_scored_as_plain_text(replace_worker):
    # the dataset's raw_prompt is the policy-rendered prompt text: used as it is, + the response
    w = replace_worker
    rendered = [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n" for q in QUESTIONS]
    out = w.compute_rewards(_batch(w.tokenizer, rendered))
    tok = w.reward_model.tokenizer
    expected = [_logit(w.reward_model.model, tok(p + r).input_ids) for p, r in zip(rendered, RESPONSES, strict=True)]
    torch.testing.assert_close(torch.tensor(out["rm_score"]), torch.tensor(expected))


def test_scores_do_not_depend_on_micro_batch_or_padding(replace_worker):
    scorer = replace_worker.reward_model
    prompts, responses = _messages(), RESPONSES
    by_two = scorer.score(prompts, responses).scores  # micro_batch_trajectories=2: rows 0-1 padded together
    one_by_one = [scorer.score([p], [r]).scores[0] for p, r in zip(prompts, responses, strict=True)]
    torch.testing.assert_close(torch.tensor(by_two), torch.tensor(one_by_one))


# ---- (2) the reward model's own tokenizer (other vocabulary, right padding) --------------------
def _other_tokenizer():
    """A char tokenizer whose ids are NOT the policy's: specials <pad>=0, <s>=1, </s>=2, then the
    printable characters in reverse order; right padding; its own chat template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(i) for i in range(126, 31, -1)] + ["\n"]
    specials = ["<pad>", "<s>", "</s>"]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate([*specials, *chars])}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                  padding_side="right")
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    return tok


@pytest.fixture(scope="module")
def other_rm_folder(tmp_path_factory):
    tok = _other_tokenizer()
    folder = tmp_path_factory.mktemp("rm")
    build_tiny_reward_model(len(tok), seed=5, pad_token_id=tok.pad_token_id).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_reward_model_with_its_own_tokenizer_sees_its_own_ids(other_rm_folder):
    w = _worker(f"reward.model.path={other_rm_folder}", "reward.model.combine=replace")
    try:
        rm_tok = w.reward_model.tokenizer
        assert rm_tok.padding_side == "right" and w.reward_model.pad_token_id == 0
        seen = _SeenIds(w.reward_model.model)
        out = w.compute_rewards(_batch(w.tokenizer, _messages()))
        seen.handle.remove()
        texts = [f"[user] {q}\n[assistant] {r}\n" for q, r in zip(QUESTIONS, RESPONSES, strict=True)]
        want = [rm_tok(t, add_special_tokens=False).input_ids for t in texts]
        assert seen.rows() == want  # the reward model saw its own tokenization of the rebuilt conversation
        policy_ids = [w.tokenizer(t, add_special_tokens=False).input_ids for t in texts]
        assert all(a != b for a, b in zip(want, policy_ids, strict=True))  # a different vocabulary
        ids, mask = seen.calls[0]
        assert mask[:, 0].all() and not mask[:, -1].all()  # right padding: the pads are at the end
        assert (ids[~mask.bool()] == 0).all()  # padded with the reward model's pad id
        expected = [_logit(w.reward_model.model, x) for x in want]
        torch.testing.assert_close(torch.tensor(out["rm_score"]), torch.tensor(expected))
    finally:
        w.close()


# ---- (3) add vs replace ------------------------------------------------------------------------
def test_combine_scores_by_hand():
    # rule [1, 0], rm [0.5, -2], weight 2: add → [1 + 1, 0 − 4]; replace → [1, −4]
    assert combine_scores([1.0, 0.0], [0.5, -2.0], 2.0, "add") == [2.0, -4.0]
    assert combine_scores([1.0, 0.0], [0.5, -2.0], 2.0, "replace") == [1.0, -4.0]


def test_add_sums_rule_and_weighted_model_score_replace_skips_rules(replace_worker):
    batch_args = (replace_worker.tokenizer, _messages())
    replaced = replace_worker.compute_rewards(_batch(*batch_args))
    assert replace_worker.executor._pool is None  # replace: the rule processes never started
    assert replaced["reward_failure"] == [None] * 3 and "acc" not in replaced
    rm = replaced["rm_score"]
    assert replaced["score"] == pytest.approx([2.0 * x for x in rm], abs=1e-6)

    w = _worker("reward.model.path=tiny", "reward.model.weight=0.5")  # same seed → same model
    try:
        added = w.compute_rewards(_batch(*batch_args))
    finally:
        w.close()
    assert added["acc"] == [1.0, 0.0, 1.0]  # the arith rule ran: 2 ✓, 24 ≠ 25, 42 ✓
    assert added["rm_score"] == pytest.approx(rm, abs=1e-5)  # other micro-batches: float32 rounding only
    assert added["score"] == pytest.approx([1.0 + 0.5 * added["rm_score"][0], 0.0 + 0.5 * added["rm_score"][1],
                                            1.0 + 0.5 * added["rm_score"][2]])
    cols = _last_column(added)
    assert [float(added["token_level_scores"][i, c]) for i, c in enumerate(cols)] == pytest.approx(added["score"])
    m = added.meta["metrics"]
    assert m["reward/rule_score/mean"] == pytest.approx(2 / 3)
    assert m["critic/score/mean"] == pytest.approx(sum(added["score"]) / 3)


# ---- (4) truncation ------------------------------------------------------------------------------
def test_long_rows_lose_their_prompt_start_and_are_counted():
    w = _worker("reward.model.path=tiny", "reward.model.combine=replace", "reward.model.max_length=28")
    try:
        seen = _SeenIds(w.reward_model.model)
        out = w.compute_rewards(_batch(w.tokenizer, _messages()))
        seen.handle.remove()
    finally:
        w.close()
    tok = w.reward_model.tokenizer
    full = [tok(_chatml(q, r), add_special_tokens=False).input_ids for q, r in zip(QUESTIONS, RESPONSES, strict=True)]
    # char tokenizer: the ChatML frame is <|im_start|> "user\n"(5) <|im_end|> "\n" <|im_start|> "assistant\n"(10)
    # <|im_end|> "\n" = 21 tokens; rows: 21 + 4 + 9 = 34, 21 + 5 + 2 = 28, 21 + 4 + 4 = 29
    assert [len(x) for x in full] == [34, 28, 29]
    # max_length 28: rows 0 and 2 lose their first 6 and 1 tokens (the prompt's start); row 1 fits exactly
    assert seen.rows() == [full[0][6:], full[1], full[2][1:]]
    assert out.meta["metrics"]["reward/rm_truncated"] == 2.0
    expected = [_logit(w.reward_model.model, x[-28:]) for x in full]
    torch.testing.assert_close(torch.tensor(out["rm_score"]), torch.tensor(expected))


def test_truncate_left_and_pad_rows_by_hand():
    assert truncate_left([1, 2, 3, 4], 3) == ([2, 3, 4], True)
    assert truncate_left([1, 2], 3) == ([1, 2], False)
    ids, mask = pad_rows([[5], [6, 7]], 0, "left")
    assert ids.tolist() == [[0, 5], [6, 7]] and mask.tolist() == [[False, True], [True, True]]
    ids, mask = pad_rows([[5], [6, 7]], 0, "right")
    assert ids.tolist() == [[5, 0], [6, 7]] and mask.tolist() == [[True, False], [True, True]]


# ---- (5) bad config ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["reward.model.path=tiny", "reward.model.weight=-1"], "reward.model.weight"),
        (["reward.model.path=tiny", "reward.model.weight=0"], "reward.model.weight=0"),
        (["reward.model.combine=replace"], "reward.model.combine='replace' needs reward.model.path"),
        (["reward.model.path=tiny", "reward.model.combine=replace", "reward.function=m:f"], "reward.function"),
        (["reward.model.path=tiny", "reward.model.max_length=0"], "reward.model.max_length"),
    ],
)
def test_bad_config_names_the_field(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("(", r"\(")):
        tiny_cfg(*overrides)


def test_unknown_or_wrong_model_path_names_the_field(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"reward\.model\.path='/nonexistent/rm'"):
        RewardWorker(tiny_cfg("reward.model.path=/nonexistent/rm"))
    tok = build_tiny_tokenizer()  # a causal LM folder: its score head would be random
    build_tiny_model(len(tok), hidden_size=16, layers=1).save_pretrained(tmp_path / "lm")
    tok.save_pretrained(tmp_path / "lm")
    with pytest.raises(ValueError, match=r"reward\.model\.path=.*LlamaForCausalLM.*ForSequenceClassification"):
        RewardWorker(tiny_cfg(f"reward.model.path={tmp_path / 'lm'}"))


def test_dataset_chat_messages_win_over_the_rendered_text(replace_worker):
    # the dataset gives both raw_prompt (policy-rendered text) and raw_chat (messages): the reward
    # model must see its own rendering of the messages, not the policy's text
    w = replace_worker
    rendered = [f"SYSTEM of the policy\n{q}\n" for q in QUESTIONS]
    batch = _batch(w.tokenizer, rendered)
    batch.set("raw_chat", _messages())
    out = w.compute_rewards(batch)
    tok = w.reward_model.tokenizer
    expected = [_logit(w.reward_model.model, tok(_chatml(q, r), add_special_tokens=False).input_ids)
                for q, r in zip(QUESTIONS, RESPONSES, strict=True)]
    torch.testing.assert_close(torch.tensor(out["rm_score"]), torch.tensor(expected))
