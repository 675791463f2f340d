"""Rollout protocol pieces: SamplingParams, RolloutOutput, registry, the sampler's distribution."""

from __future__ import annotations

import math

import pytest
import torch

from workers.rollout.base import (
    RolloutOutput,
    SamplingParams,
    finalize_responses,
    get_rollout_engine,
    register_rollout_engine,
    right_pad,
    rollout_engine_names,
    sampling_params_from_config,
)
from workers.rollout.hf import HFRolloutEngine, top_k_top_p_filter
from workers.rollout.hf_sampler import RolloutSampler


def test_sampling_params_validation_and_greedy_temperature():
    assert SamplingParams(max_new_tokens=4, temperature=0).logprob_temperature == 1.0
    assert SamplingParams(max_new_tokens=4, temperature=0.5).logprob_temperature == 0.5
    assert SamplingParams(max_new_tokens=4, stop_token_ids=[2, 7]).stop_token_ids == (2, 7)
    for bad in ({"max_new_tokens": 0}, {"max_new_tokens": 4, "top_p": 0}, {"max_new_tokens": 4, "n": 0}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_sampling_params_from_config_adds_tokenizer_stops_first():
    from hybridflow.config import RolloutConfig

    cfg = RolloutConfig(stop_token_ids=[7, 2], samples_per_prompt=3, temperature=0.8, val_samples_per_prompt=1)
    train = sampling_params_from_config(cfg, [2, 0], seed=5)
    assert train.stop_token_ids == (2, 0, 7) and train.n == 3 and train.temperature == 0.8 and train.seed == 5
    val = sampling_params_from_config(cfg, [2], validation=True)
    assert val.temperature == 0.0 and val.n == 1


def test_finalize_masks_through_first_stop_and_pads_after_it():
    # stop ids {2, 3}; pad 0. Row 0 stops at position 2, row 1 never stops.
    ids = torch.tensor([[11, 12, 3, 14, 2], [5, 6, 7, 8, 9]])
    lp = torch.full((2, 5), -1.5)
    out = finalize_responses(ids, lp, [2, 3], pad_token_id=0)
    assert out.response_ids.tolist() == [[11, 12, 3, 0, 0], [5, 6, 7, 8, 9]]
    assert out.response_mask.tolist() == [[True, True, True, False, False], [True] * 5]
    assert out.rollout_log_probs.tolist() == [[-1.5, -1.5, -1.5, 0.0, 0.0], [-1.5] * 5]
    assert out.finish_reason == ["stop", "length"]


def test_rollout_output_checks_shapes_and_dtypes():
    ok = dict(
        response_ids=torch.zeros(2, 3, dtype=torch.int64),
        response_mask=torch.ones(2, 3, dtype=torch.bool),
        rollout_log_probs=torch.zeros(2, 3),
        finish_reason=["stop", "length"],
    )
    assert len(RolloutOutput(**ok)) == 2
    with pytest.raises(ValueError, match="rollout_log_probs"):
        RolloutOutput(**{**ok, "rollout_log_probs": torch.zeros(2, 3, dtype=torch.float64)})
    with pytest.raises(ValueError, match="finish_reason"):
        RolloutOutput(**{**ok, "finish_reason": ["stop"]})


def test_right_pad():
    a, b = torch.tensor([[1, 2]]), torch.tensor([[3, 4, 5]])
    assert right_pad([a, b], 9).tolist() == [[1, 2, 9], [3, 4, 5]]


def test_registry_lists_builtins_and_rejects_duplicates_and_unknowns():
    assert get_rollout_engine("hf") is HFRolloutEngine
    assert {"hf", "vllm"} <= set(rollout_engine_names())
    with pytest.raises(ValueError, match="already registered"):
        register_rollout_engine("hf")(object)
    with pytest.raises(KeyError, match="known: hf, vllm"):
        get_rollout_engine("sglang")


def test_top_k_top_p_filter_hand_worked():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    # top-k 2 keeps the two largest logits, 3 and 2
    assert torch.isinf(top_k_top_p_filter(logits, 2, 1.0)).tolist() == [[False, True, False, True]]
    # probs 0.5, 0.3, 0.2: sorted ascending 0.2, 0.3, 0.5, cumulative 0.2, 0.5, 1.0;
    # top-p 0.6 drops tokens whose cumulative mass ≤ 1 − 0.6 = 0.4 → only the 0.2 token
    probs = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    assert torch.isinf(top_k_top_p_filter(probs, -1, 0.6)).tolist() == [[False, False, True]]
    # top-p 0.4: drops cumulative ≤ 0.6 → 0.2 and 0.3 go, 0.5 stays
    assert torch.isinf(top_k_top_p_filter(probs, -1, 0.4)).tolist() == [[False, True, True]]


def _sample_counts(sampling: SamplingParams, logits: torch.Tensor, rows: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    sampler = RolloutSampler(sampling, prompt_len=1, uniforms=torch.rand(rows, 1, generator=gen))
    out = sampler(torch.zeros(rows, 1, dtype=torch.int64), logits.expand(rows, -1).clone())
    chosen = out.argmax(-1)  # generate runs greedily over the sampler's one-hot scores
    assert (out.isfinite().sum(-1) == 1).all()
    return torch.bincount(chosen, minlength=logits.shape[-1]).float()


def test_sampler_draws_from_softmax_of_logits_over_temperature():
    # logits [2, 1, 0, -1] at T = 0.5 → softmax([4, 2, 0, -2]) = e^{4,2,0,-2} / (54.598 + 7.389 + 1 + 0.135)
    #   = [0.86495, 0.11706, 0.01584, 0.00214]
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    expected = torch.tensor([math.exp(v) for v in (4, 2, 0, -2)])
    expected /= expected.sum()
    rows = 20000
    counts = _sample_counts(SamplingParams(max_new_tokens=1, temperature=0.5), logits, rows)
    # each frequency within 4 standard errors sqrt(p(1-p)/N) of its probability
    se = (expected * (1 - expected) / rows).sqrt()
    assert ((counts / rows - expected).abs() < 4 * se + 1e-4).all(), (counts / rows, expected)


def test_sampler_with_top_k_renormalises_over_the_kept_tokens():
    # top-k 2 at T = 1 on [2, 1, 0, -1]: p ∝ [e^2, e^1] = [0.73106, 0.26894], 0 elsewhere
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    rows = 20000
    counts = _sample_counts(SamplingParams(max_new_tokens=1, top_k=2), logits, rows)
    assert counts[2:].sum() == 0
    assert abs(counts[0] / rows - 0.73106) < 4 * math.sqrt(0.73106 * 0.26894 / rows)


def test_sampler_reports_full_distribution_log_probs_at_temperature():
    # the reported log-prob ignores top-k: log softmax([2,1,0,-1] / 0.5)[0] = 4 − log(63.122) = −0.14508
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    sampler = RolloutSampler(SamplingParams(max_new_tokens=1, temperature=0.5, top_k=2), 1, torch.full((1, 1), 0.1))
    out = sampler(torch.zeros(1, 1, dtype=torch.int64), logits.clone())
    token = out.argmax(-1, keepdim=True)
    assert token.item() == 0  # u = 0.1 falls in the first token's CDF interval
    assert sampler.log_probs(token).item() == pytest.approx(-0.14508, abs=1e-4)
