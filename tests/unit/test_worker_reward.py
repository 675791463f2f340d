"""RewardWorker without Ray: a hand-made batch scored by the arith rule reward."""

from __future__ import annotations

import pytest
import torch

from hybridflow.batch import Batch
from tests.unit._worker_helpers import response_batch, tiny_cfg
from workers.reward import RewardWorker, place_scores


def test_place_scores_on_last_valid_token():
    mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    out = place_scores([1.0, 0.5, -1.0], mask)
    # rows of length 2, 1, 0 → columns 1, 0, 0
    assert torch.equal(out, torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.0], [-1.0, 0.0, 0.0]]))


@pytest.fixture(scope="module")
def worker():
    w = RewardWorker(tiny_cfg())
    yield w
    w.close()


def _batch(tokenizer, responses: list[str], truths: list[str], width: int = 12) -> Batch:
    return response_batch(tokenizer, responses, truths, width)


def test_scores_rows_and_places_them(worker):
    # "\boxed{2}" is right for truth 2; "7" is wrong for 2; "25" is right for 25 (no box: last number)
    batch = _batch(worker.tokenizer, ["\\boxed{2}", "7", "x=25"], ["2", "2", "25"])
    out = worker.compute_rewards(batch)
    assert out["score"] == [1.0, 0.0, 1.0]
    assert out["acc"] == [1.0, 0.0, 1.0]
    assert out["reward_failure"] == [None, None, None]
    scores = out["token_level_scores"]
    assert scores.dtype == torch.float32 and scores.shape == (3, 12)
    # "\boxed{2}" is 9 chars + <|im_end|> → last valid column 9; "7" → 1; "x=25" → 4
    assert scores[0, 9] == 1.0 and scores[1, 1] == 0.0 and scores[2, 4] == 1.0
    assert scores.sum() == 2.0
    m = out.meta["metrics"]
    assert m["critic/score/mean"] == pytest.approx(2 / 3) and m["critic/score/arith/mean"] == pytest.approx(2 / 3)
    assert m["critic/score/max"] == 1.0 and m["critic/score/min"] == 0.0
    assert m["reward/errors"] == 0.0 and m["reward/arith/acc/mean"] == pytest.approx(2 / 3)
    assert out.meta["logs"] == []


def test_reward_failure_is_counted_not_raised(worker):
    # "abc" is no number: the arith reward raises for the ground truth → scored reward.on_error (0)
    batch = _batch(worker.tokenizer, ["2", "2"], ["2", "abc"])
    out = worker.compute_rewards(batch)
    assert out["score"] == [1.0, 0.0]
    assert out["reward_failure"] == [None, "error"]
    assert out.meta["metrics"]["reward/errors"] == 1.0
    assert len(out.meta["logs"]) == 1 and "row 1" in out.meta["logs"][0]


def test_place_scores_on_last_model_token_of_a_multi_turn_mask():
    # model turn | observation | model turn | padding: the score goes on column 4, not on mask.sum() - 1 = 2
    mask = torch.tensor([[True, True, False, False, True, False]])
    assert place_scores([2.0], mask)[0].tolist() == [0.0, 0.0, 0.0, 0.0, 2.0, 0.0]


def test_multi_turn_rows_env_reward_and_final_turn(worker):
    # rows 0/1 carry environment rewards, row 2 none; the rule reward scores the last assistant turn
    batch = _batch(worker.tokenizer, ["<call>", "<call>", "<call>"], ["5", "5", "5"])
    msgs = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "<call>"},
             {"role": "tool", "content": "5"}, {"role": "assistant", "content": f"it is {a}"}] for a in (5, 4, 5)]
    batch.set("messages", msgs)
    batch.set("env_reward", [0.5, -1.0, None])
    out = worker.compute_rewards(batch)
    assert out["score"] == [0.5, -1.0, 1.0]  # reward.combine='replace'; row 2: the rule score of "it is 5"
    added = RewardWorker(tiny_cfg("reward.combine=add"))
    try:
        assert added.compute_rewards(batch)["score"] == [1.5, -1.0, 1.0]  # env + rule (1, 0, 1)
    finally:
        added.close()
