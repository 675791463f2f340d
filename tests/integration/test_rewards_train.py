"""verl data sources end to end: one training iteration of the train flow (what ``hybridflow train``
runs) on the tiny random model, with a ``math_dapo`` dataset and with a code dataset whose rows carry
unit tests, scored by the reward pool through the registry (code: in the sandbox, per test case)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.conftest import tiny_overrides

pytestmark = pytest.mark.integration


def _row(source: str, question: str, truth: str, i: int) -> dict:
    return {"data_source": source, "prompt": [{"role": "user", "content": question}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"index": i}}  # fmt: skip


@pytest.fixture(scope="module")
def verl_file(tmp_path_factory):
    """Two math_dapo rows and two code rows (each with 2 unit tests) in one parquet."""
    from hybridflow.data import write_rows

    d = tmp_path_factory.mktemp("verl-data")
    dapo = [_row("math_dapo", f"What is {i} + {i}? End with 'Answer: N'.", str(2 * i), i) for i in range(2)]
    tests = [json.dumps({"inputs": [f"{i}\n", f"{i + 1}\n"], "outputs": [f"{2 * i}\n", f"{2 * i + 2}\n"]})
             for i in range(2)]  # fmt: skip
    code = [_row("codecontests", "Read n and print 2n. Answer in a ```python block.", t, 2 + i)
            for i, t in enumerate(tests)]  # fmt: skip
    write_rows(dapo + code, str(d / "verl.parquet"))
    return str(d / "verl.parquet")


def test_one_iteration_scores_math_dapo_and_code_rows(prefect_api, ray_cluster, verl_file, tmp_path):
    from flows.train import train

    ov = tiny_overrides(str(tmp_path / "runs"), verl_file, verl_file, **{
        "trainer.run_id": "verl-sources", "trainer.total_iterations": "1", "data.prompts_per_iteration": "4",
        "rollout.max_response_tokens": "8", "reward.code_case_timeout_s": "5", "reward.timeout_s": "30",
    })  # fmt: skip
    summary = train(overrides=ov)
    assert summary["iterations"] == 1
    metrics = json.loads((Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()[0])["metrics"]
    assert metrics["reward/errors"] == 0 and metrics["reward/timeouts"] == 0 and metrics["reward/crashes"] == 0
    # all 4 prompts × 2 samples: 8 random tokens never hold the right "Answer:" (DAPO's -1) ...
    assert metrics["reward/math_dapo/mean"] == -1.0 and metrics["reward/math_dapo/acc/mean"] == 0.0
    # ... and each code response ran as a program on its row's 2 test cases in the sandbox, passing none
    assert metrics["reward/codecontests/mean"] == 0.0 and metrics["reward/codecontests/passed/mean"] == 0.0
    assert "reward/codecontests/timeouts/mean" in metrics
    assert metrics["critic/score/mean"] == pytest.approx((4 * -1.0 + 4 * 0.0) / 8)
