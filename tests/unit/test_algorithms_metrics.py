"""hybridflow.metrics: verl-named data metrics, throughput/MFU, MLflow-safe names."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.batch import Batch
from hybridflow.metrics import compute_data_metrics, compute_throughput_metrics, sanitize_metric_name


def test_data_metrics_reference_values():
    mask = torch.tensor([[True, True, True], [True, False, False]])
    batch = Batch.from_dict(
        {
            "response_mask": mask,
            "prompt_mask": torch.tensor([[False, True, True], [True, True, True]]),
            "token_level_scores": torch.tensor([[0.0, 0.0, 1.0], [0.5, 7.0, 7.0]]),
            "token_level_rewards": torch.tensor([[0.0, 0.1, 1.0], [0.5, 7.0, 7.0]]),
            "advantages": torch.tensor([[1.0, 1.0, 1.0], [-2.0, 9.0, 9.0]]),
            "returns": torch.tensor([[2.0, 2.0, 2.0], [4.0, 9.0, 9.0]]),
            "values": torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]]),
        },
        {"uid": ["a", "a"]},
    )
    m = compute_data_metrics(batch, max_response_tokens=3)
    # scores per sequence: 1.0 and 0.5 (the 7s are padding) ; rewards: 1.1 and 0.5
    assert (m["critic/score/mean"], m["critic/score/max"], m["critic/score/min"]) == (0.75, 1.0, 0.5)
    assert m["critic/rewards/mean"] == pytest.approx(0.8)
    # valid advantages 1, 1, 1, −2 → mean −0.25/… = (3 − 2)/4 = 0.25, max 1, min −2
    assert (m["critic/advantages/mean"], m["critic/advantages/max"], m["critic/advantages/min"]) == (0.25, 1.0, -2.0)
    assert m["critic/returns/mean"] == 2.5  # (2+2+2+4)/4
    assert m["critic/values/mean"] == 2.5  # (1+2+3+4)/4
    # explained variance: returns [2,2,2,4] var 0.75; returns − values [1,0,−1,0] var 0.5 → 1 − 0.5/0.75
    assert m["critic/vf_explained_var"] == pytest.approx(1 / 3)
    # lengths 3 and 1; one of two hit the 3-token limit
    assert (m["response_length/mean"], m["response_length/max"], m["response_length/min"]) == (2.0, 3.0, 1.0)
    assert m["response_length/clip_ratio"] == 0.5
    assert m["prompt_length/mean"] == 2.5


def test_data_metrics_leave_out_what_is_absent():
    batch = Batch.from_dict({"response_mask": torch.zeros(2, 3, dtype=torch.bool)})
    m = compute_data_metrics(batch, max_response_tokens=3)
    assert "critic/values/mean" not in m and "critic/score/mean" not in m
    assert m["response_length/mean"] == 0.0 and m["response_length/clip_ratio"] == 0.0


def test_throughput_and_mfu():
    # 1000 tokens in 2 s on 2 devices → 250 tokens/s/device
    # MFU: 6 · 1e6 params · 1000 tokens / 2 s = 3e9 FLOP/s over 2 · 1e12 peak → 0.0015
    m = compute_throughput_metrics(1000, 2.0, n_params=1_000_000, flops_per_s_peak=1e12, n_devices=2)
    assert m == {"perf/total_num_tokens": 1000.0, "perf/throughput": 250.0, "perf/mfu/actor": pytest.approx(0.0015)}
    assert "perf/mfu/actor" not in compute_throughput_metrics(10, 1.0)
    with pytest.raises(ValueError, match="seconds"):
        compute_throughput_metrics(10, 0.0)


def test_sanitize_examples():
    assert sanitize_metric_name("actor/pg_loss") == "actor/pg_loss"
    assert sanitize_metric_name("val/acc@4 (gsm8k)") == "val/acc_4 _gsm8k_"
    assert sanitize_metric_name("/timing_s//gen/") == "timing_s/gen"
    assert sanitize_metric_name("a/../b") == "a/__/b"
    assert sanitize_metric_name("..hidden") == "_.hidden"
    assert sanitize_metric_name("") == "_"


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_sanitized_names_pass_mlflow_validation(name):
    from mlflow.utils.validation import _validate_metric_name

    clean = sanitize_metric_name(name)
    _validate_metric_name(clean)  # raises MlflowException if MLflow would refuse it
    assert len(clean) <= 250
    assert sanitize_metric_name(clean) == clean  # idempotent
