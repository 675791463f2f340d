"""PromptDataset: chat template without a second BOS, left padding, overlong policies, collate."""

import json

import pytest
import torch

from hybridflow.config import DataConfig
from hybridflow.data import OverlongPromptError, PromptDataset, load_rows
from hybridflow.data.rows import Row
from hybridflow.data.testing import char_tokenizer

BOS = 1


def _row(content, i=0, truth="1"):
    return Row("arith", [{"role": "user", "content": content}], truth, {"index": i}, "math", "rule", "f.jsonl", i, f"f-{i}")


def _template_len(content):
    # "<|im_start|>" + "user\n" + content + "<|im_end|>" + "\n" + "<|im_start|>" + "assistant\n"
    return 1 + 5 + len(content) + 1 + 1 + 1 + 10


@pytest.mark.parametrize(
    "template_emits_bos, adds_bos, bos_count",
    [
        (True, True, 1),  # template writes BOS, tokenizer would add one too: still exactly one
        (True, False, 1),
        (False, True, 1),  # template has no BOS, tokenizer normally adds it: added once
        (False, False, 0),  # neither: none
    ],
)
def test_exactly_one_bos(template_emits_bos, adds_bos, bos_count):
    tok = char_tokenizer(template_emits_bos=template_emits_bos, adds_bos=adds_bos)
    ds = PromptDataset([_row("7+5?")], tok, DataConfig())
    ids = ds[0]["prompt_ids"]
    assert ids.count(BOS) == bos_count
    assert len(ids) == _template_len("7+5?") + bos_count
    assert ds[0]["raw_prompt"].endswith("<|im_start|>assistant\n")  # generation prompt added


def test_collate_left_pads_with_the_pad_id():
    tok = char_tokenizer()
    ds = PromptDataset([_row("ab", 0, "3"), _row("abcde", 1, "4")], tok, DataConfig())
    batch = ds.collate([1, 0])
    long, short = _template_len("abcde"), _template_len("ab")  # 24 and 21 tokens
    assert batch["prompt_ids"].shape == (2, long) and batch["prompt_ids"].dtype == torch.int64
    assert batch["prompt_mask"].dtype == torch.bool
    assert batch["prompt_mask"].sum(1).tolist() == [long, short]
    pad = long - short  # 3 pad positions on the LEFT of the short prompt
    assert batch["prompt_ids"][1, :pad].tolist() == [tok.pad_token_id] * pad
    assert not batch["prompt_mask"][1, :pad].any() and batch["prompt_mask"][1, pad:].all()
    assert batch["prompt_ids"][1, pad:].tolist() == ds[0]["prompt_ids"]
    assert batch["uid"] == ["f-1", "f-0"] and batch["ground_truth"] == ["4", "3"]
    assert batch["data_source"] == ["arith", "arith"] and batch["extra_info"] == [{"index": 1}, {"index": 0}]
    assert batch["raw_prompt"][0] == tok.decode(ds[1]["prompt_ids"])
    assert batch["raw_chat"][0] == ds.rows[1].prompt and isinstance(batch["raw_chat"][0], list)  # the messages
    json.dumps(batch.non_tensors)  # every non-tensor field is JSON-serialisable


def test_pad_falls_back_to_eos_when_there_is_no_pad_token():
    tok = char_tokenizer(pad=False)
    ds = PromptDataset([_row("a"), _row("abc", 1)], tok, DataConfig())
    assert ds.pad_token_id == tok.eos_token_id
    assert ds.collate([0, 1])["prompt_ids"][0, 0].item() == tok.eos_token_id


def test_overlong_error_names_row_and_length():
    rows = [_row("short"), _row("x" * 40, 1)]
    limit = _template_len("short")  # 24: the first row fits exactly, the second (59) does not
    with pytest.raises(OverlongPromptError, match=r"row 1 \(uid f-1, f.jsonl row 1\) is 59 tokens.*max_prompt_tokens=24"):
        PromptDataset(rows, char_tokenizer(), DataConfig(max_prompt_tokens=limit))


def test_overlong_filter_counts():
    rows = [_row("short"), _row("x" * 40, 1), _row("y" * 40, 2), _row("ok", 3)]
    ds = PromptDataset(rows, char_tokenizer(), DataConfig(max_prompt_tokens=24, overlong_prompt="filter"))
    assert len(ds) == 2 and ds.filtered == 2 and ds.filtered_uids == ["f-1", "f-2"]
    assert ds.collate([0, 1])["uid"] == ["f-0", "f-3"]


def test_overlong_truncate_left_keeps_the_end():
    tok = char_tokenizer()
    ds = PromptDataset([_row("x" * 40)], tok, DataConfig(max_prompt_tokens=24, overlong_prompt="truncate_left"))
    full = PromptDataset([_row("x" * 40)], tok, DataConfig(max_prompt_tokens=256))
    assert ds.truncated == 1 and ds[0]["prompt_ids"] == full[0]["prompt_ids"][-24:]
    assert ds[0]["raw_prompt"].endswith("<|im_start|>assistant\n") and len(ds[0]["raw_prompt"]) < len(full[0]["raw_prompt"])


def test_string_prompts_without_chat_template_get_the_tokenizers_bos(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps({"data_source": "arith", "prompt": "Q: 2+2=", "reward_model": {"ground_truth": "4"}}) + "\n")
    cfg = DataConfig(apply_chat_template=False)
    ds = PromptDataset(load_rows([str(path)], cfg), char_tokenizer(adds_bos=True), cfg)
    assert ds[0]["prompt_ids"][0] == BOS and len(ds[0]["prompt_ids"]) == 1 + len("Q: 2+2=")
    assert ds.collate([0])["raw_prompt"] == ["Q: 2+2="]


def test_missing_chat_template_is_an_error():
    tok = char_tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        PromptDataset([_row("a")], tok, DataConfig())
