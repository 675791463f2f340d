"""docs/extending.md's three examples (tests/integration/extending/): the doc shows their code as it
is, each is under 40 lines, hand-worked values of the estimator and the two nodes, and the wiring
they give for a config. Training one iteration with them: tests/integration/test_extending_examples.py."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from hybridflow.batch import Batch
from tests.integration.extending import best_of_n, combined, estimator, kl_probe
from tests.unit._worker_helpers import tiny_cfg

DOC = Path(__file__).resolve().parents[2] / "docs" / "extending.md"
EXAMPLES = (estimator, best_of_n, kl_probe)


@pytest.mark.parametrize("module", EXAMPLES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_the_doc_shows_each_example_module_as_it_is_and_it_is_under_40_lines(module):
    blocks = [b.strip() for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)]
    source = Path(module.__file__).read_text()
    assert source.strip() in blocks, f"docs/extending.md does not show {module.__file__} as it is"
    assert len(source.splitlines()) < 40


def test_batch_mean_baseline_by_hand():
    # scores over the mask: row 0: 0 + 1 = 1; row 1: 0 (the 5 is outside the mask); row 2: 2 → mean 1
    rewards = torch.tensor([[0.0, 1.0], [0.0, 5.0], [2.0, 0.0]])
    mask = torch.tensor([[True, True], [True, False], [True, False]])
    advantages, returns = estimator.batch_mean_baseline(rewards, mask)
    expected = torch.tensor([[0.0, 0.0], [-1.0, 0.0], [1.0, 0.0]])  # A = (1−1, 0−1, 2−1) on the mask
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, expected)


def _groups_batch():
    # two prompts sampled 3 times each, interleaved: uid a = rows 0, 2, 4; uid b = rows 1, 3, 5
    scores = [0.1, 0.3, 0.9, 0.3, 0.5, 0.2]
    uid = ["a", "b", "a", "b", "a", "b"]
    rollout = Batch.from_dict({"response_mask": torch.ones(6, 2, dtype=torch.bool),
                               "row": torch.arange(6)}, {"uid": uid})
    reward = Batch.from_dict({"token_level_scores": torch.tensor([[0.0, s] for s in scores])}, {"uid": uid})
    reference = Batch.from_dict({"ref_log_probs": -torch.arange(12.0).reshape(6, 2)}, {"uid": uid})
    return rollout, reward, reference


def test_best_of_n_keeps_each_prompts_top_k_by_hand():
    assert best_of_n.TOP_K == 2
    rollout, reward, reference = _groups_batch()
    kept, metrics = best_of_n.best_of_n.fn(None, rollout, reward, reference)
    # a: 0.9 (row 2) and 0.5 (row 4); b: 0.3 (row 1) and 0.3 (row 3) — the tie keeps the earlier two
    assert kept["row"].tolist() == [1, 2, 3, 4]
    assert kept.non_tensors["uid"] == ["b", "a", "b", "a"]
    torch.testing.assert_close(kept["ref_log_probs"], reference["ref_log_probs"][1:5])
    assert metrics["best_of_n/kept_score_mean"] == pytest.approx((0.3 + 0.9 + 0.3 + 0.5) / 4)


def test_kl_probe_by_hand():
    rollout = Batch.from_dict({"old_log_probs": torch.tensor([[-1.0, -2.0, -9.0]]),
                               "response_mask": torch.tensor([[True, True, False]])}, {"uid": ["a"]})
    reference = Batch.from_dict({"ref_log_probs": torch.tensor([[-1.0, -1.0, -4.0]])}, {"uid": ["a"]})
    metrics = kl_probe.kl_probe.fn(None, rollout, reference)
    # x = (0, 1) on the mask (the 5 outside it is ignored): k3 = (e⁰−0−1, e¹−1−1) = (0, e−2)
    assert metrics["kl_probe/k3_mean"] == pytest.approx((math.e - 2) / 2)
    assert metrics["kl_probe/k3_max"] == pytest.approx(math.e - 2)


@pytest.mark.parametrize("overrides, fed", [
    ((), ("rollout", "reward")),
    (("actor.use_kl_loss=true",), ("rollout", "reward", "reference")),
    (("algorithm.adv_estimator=gae",), ("rollout", "reward", "values")),
])
def test_best_of_n_feeds_every_batch_the_advantage_reads(overrides, fed):
    df = best_of_n.build_dataflow(tiny_cfg(*overrides))
    for p in ("rollout", "reward", "reference", "values"):  # absent nodes: nothing provides the default
        assert df.wiring["advantage"][p] == ("best_of_n" if p in fed else None), p
    assert {p for p, src in df.wiring["best_of_n"].items() if src} == set(fed)
    assert df.order.index("best_of_n") < df.order.index("advantage")
    assert df.wiring["update_policy"]["advantage"] == "advantage"


def test_kl_probe_is_in_the_dataflow_only_when_the_config_uses_kl():
    assert "kl_probe" not in kl_probe.build_dataflow(tiny_cfg()).wiring
    with_kl = kl_probe.build_dataflow(tiny_cfg("actor.use_kl_loss=true"))
    assert with_kl.wiring["kl_probe"] == {"rollout": "rollout", "reference": "reference"}
    both = combined.build_dataflow(tiny_cfg("algorithm.use_kl_in_reward=true"))
    assert both.wiring["kl_probe"] == {"rollout": "rollout", "reference": "reference"}
    assert both.wiring["advantage"]["reference"] == "best_of_n"
    assert "kl_probe" not in combined.build_dataflow(tiny_cfg()).wiring


def test_the_doc_shows_what_dataflow_show_prints_for_example_2(capsys):
    import argparse

    from flows.cli import dataflow as dataflow_cli

    root = DOC.parents[1]
    args = argparse.Namespace(config=str(root / "examples" / "grpo_arith.yaml"),
                              overrides=["trainer.dataflow=tests.integration.extending.best_of_n:build_dataflow"])
    assert dataflow_cli.run(args) == 0
    printed = capsys.readouterr().out.strip()
    assert "advantage(rollout <- best_of_n, reward <- best_of_n" in printed
    assert printed in [b.strip() for b in re.findall(r"```text\n(.*?)```", DOC.read_text(), flags=re.S)]
