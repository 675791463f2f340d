"""bench/e2e.py: the TRL side on a tiny model with a stand-in hybridflow runner, the settings
mapping onto GRPOConfig, the reward and the round summary. No speed is asserted."""

from __future__ import annotations

import pytest

from bench import common, e2e
from bench.harness import Settings, hybridflow_phases

pytest.importorskip("trl", reason="TRL is the bench extra (pip install -e .[bench])")

TINY = Settings(model="tiny", prompts_per_step=2, samples_per_prompt=2, max_response_tokens=3,
                mini_batch_trajectories=2, micro_batch_trajectories=1)


def test_arith_reward_scores_conversational_and_plain_completions():
    got = e2e.arith_reward(
        completions=[[{"role": "assistant", "content": "so \\boxed{5}"}], "\\boxed{4}"],
        ground_truth=["5", "5"], data_source=["arith", "arith"],
    )
    assert got == [1.0, 0.0]


def test_trl_config_matches_hybridflow_batching(tmp_path):
    s = Settings(prompts_per_step=8, samples_per_prompt=4, max_response_tokens=64, mini_batch_trajectories=16,
                 micro_batch_trajectories=4)
    c = e2e.trl_config(s, str(tmp_path), iterations=3)
    # 32 trajectories per iteration: micro 4 per forward, 16/4 = 4 accumulation steps per optimizer step,
    # one generation of 32/4 = 8 micro-steps = 2 optimizer steps per iteration → 3 iterations = 6 steps
    assert (c.per_device_train_batch_size, c.gradient_accumulation_steps, c.steps_per_generation) == (4, 4, 8)
    assert c.generation_batch_size == 32 and c.num_generations == 4 and c.max_steps == 6
    assert (c.beta, c.use_vllm, c.bf16, c.gradient_checkpointing, c.top_k, c.temperature) == (
        0.0, False, False, False, 0, 1.0)


class FakeRunner:
    """Stands in for HybridflowRunner: a fixed 2 s iteration of 100 tokens."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def iteration(self, task_runner: str) -> dict:
        self.calls.append(task_runner)
        m = {"timing_s/gen": 1.0, "timing_s/reward": 0.25, "timing_s/adv": 0.25, "timing_s/update_actor": 0.25}
        return {"wall_s": 2.0, "tokens": 100, "response_tokens": 10, "metrics": m}


def test_trl_side_alternates_with_the_runner_each_iteration():
    runner = FakeRunner()
    alt = e2e.Alternation(TINY.trajectories // TINY.mini_batch_trajectories, runner, ["ray", "thread"],
                          probe_size=64)
    flops = e2e.run_trl(TINY, common.arith_rows(8), iterations=2, alt=alt)
    assert flops > 0
    assert runner.calls == ["ray", "thread", "ray", "thread"]
    assert len(alt.rounds) == 2
    for row in alt.rounds:
        assert row["peaks_gflops"]["fp32"] > 0 and row["peaks_gflops"]["bf16"] > 0
        trl = row["trl"]
        # 4 trajectories of ≤ 3 new tokens each
        assert 4 <= trl["response_tokens"] <= 12 and trl["tokens"] > trl["response_tokens"]
        assert trl["phases"]["generate"] > 0 and trl["wall_s"] >= trl["phases"]["generate"]
        assert row["hybridflow_ray"]["phases"]["other"] == pytest.approx(2.0 - 1.75)


def test_summarize_ratio_per_round():
    def side(wall, tokens):
        return {"wall_s": wall, "tokens": tokens, "response_tokens": 1, "phases": {"update": wall}}

    rounds = [{"trl": side(10.0, 100), "hybridflow_ray": side(4.0, 80)},   # 20 / 10 tok/s = 2.0
              {"trl": side(5.0, 100), "hybridflow_ray": side(4.0, 120)},   # 30 / 20 = 1.5
              {"trl": side(10.0, 100), "hybridflow_ray": side(10.0, 100)}]  # 10 / 10 = 1.0
    s = e2e.summarize(rounds)
    assert s["ratios"]["hybridflow_ray"] == {"min": 1.0, "median": 1.5, "max": 2.0, "n": 3}
    assert s["sides"]["trl"]["wall_s"]["median"] == 10.0


def test_hybridflow_phases_other_is_the_rest():
    m = {"timing_s/gen": 3.0, "timing_s/reward": 1.0, "timing_s/adv": 0.5, "timing_s/update_actor": 4.0}
    # 10 − (3 + 1 + 0.5 + 4) = 1.5
    assert hybridflow_phases(m, 10.0) == {"rollout": 3.0, "reward": 1.0, "advantage": 0.5, "update": 4.0,
                                          "other": 1.5}


def test_grid_renders_one_row_per_cell(tmp_path, capsys):
    import json

    from bench import e2e

    def cell(p, s, t, ratio):
        side = lambda wall, ph: {"wall_s": {"median": wall}, "response_tokens": {"median": 100.0},  # noqa: E731
                                 "phases_s": {k: {"median": v} for k, v in ph.items()}}  # fmt: skip
        return {"settings": {"prompts_per_step": p, "samples_per_prompt": s, "max_response_tokens": t},
                "environment": {"load_avg": [1.5, 2.0, 2.5], "date": "2026-12-02 17:38:30"}, "repeats": 3,
                "sides": {"trl": side(60.0, {"generate": 20.0, "old_log_probs_and_advantages": 10.0, "update": 30.0}),
                          "hybridflow_ray": side(30.0, {"rollout": 10.0, "advantage": 0.5, "update": 18.0,
                                                        "other": 1.5})},
                "ratios": {"hybridflow_ray": {"median": ratio, "min": ratio - 0.1, "max": ratio + 0.1}}}  # fmt: skip

    files = []
    for i, c in enumerate([(4, 8, 48, 2.1), (8, 4, 256, 1.8)]):
        files.append(tmp_path / f"c{i}.json")
        files[-1].write_text(json.dumps(cell(*c)))
    assert e2e.main(["--grid-from", ",".join(map(str, files)), "--no-docs"]) == 0
    text = capsys.readouterr().out
    # results from before precisions read as fp32 on both sides, without MFU
    assert "| 4 × 8, ≤ 48 | fp32 / fp32 | 2.10 (2.00–2.20) | 60.0 / 30.0 | 30.0 / 10.5 | 30.0 / 18.0 |" in text
    assert "| 8 × 4, ≤ 256 | fp32 / fp32 | 1.80 (1.70–1.90) |" in text and "1.5 (5.0 %)" in text


def test_trl_config_takes_the_precision(tmp_path):
    assert e2e.trl_config(TINY, str(tmp_path), iterations=1, bf16=True).bf16 is True
    assert e2e.trl_config(TINY, str(tmp_path), iterations=1).bf16 is False


@pytest.mark.parametrize("decided, bf16", [("bf16-mixed", True), ("fp32", False)])
def test_trl_precision_auto_follows_hybridflows_decision(monkeypatch, decided, bf16):
    from hybridflow import precision_probe
    from hybridflow.precision import resolve_precision

    seen = []

    def fake_decide(cfg, widths=None):
        seen.append(cfg.model.precision)
        return resolve_precision(decided, device_type="cpu")

    monkeypatch.setattr(precision_probe, "decide_precision", fake_decide)
    got = e2e.trl_precision("auto", "tiny")
    assert seen == ["auto"]  # TRL's side asks the same decision as a hybridflow run with model.precision=auto
    assert got["bf16"] is bf16 and got["name"] == decided


def test_trl_precision_forced():
    assert e2e.trl_precision("bf16", "tiny")["bf16"] is True
    assert e2e.trl_precision("fp32", "tiny") | {"probe": None} == {
        "bf16": False, "name": "fp32", "requested": "fp32", "reason": "set by --trl-precision", "probe": None}


def test_settings_carry_precision_and_rollout_dtype():
    ov = Settings(precision="auto", rollout_dtype="auto").overrides("/r", "/t.jsonl")
    assert "model.precision=auto" in ov and "rollout.dtype=auto" in ov
    ov = Settings().overrides("/r", "/t.jsonl")
    assert "model.precision=fp32" in ov and not any(o.startswith("rollout.dtype=") for o in ov)


def test_mfu_against_both_peaks():
    # 100 tokens, 2N = 1e9 FLOPs: iteration 4e11 FLOP in 2 s = 200 GFLOP/s; update 3e11 in 1 s = 300
    side = {"wall_s": 2.0, "tokens": 100, "phases": {"update": 1.0}}
    m = e2e.mfu(side, {"fp32": 200.0, "bf16": 800.0}, 1e9)
    assert m["iteration_gflops"] == pytest.approx(200.0) and m["update_gflops"] == pytest.approx(300.0)
    assert m["iteration_mfu_vs_fp32_peak"] == pytest.approx(1.0)
    assert m["iteration_mfu_vs_best_peak"] == pytest.approx(0.25)
    assert m["update_mfu_vs_fp32_peak"] == pytest.approx(1.5) and m["update_mfu_vs_best_peak"] == pytest.approx(0.375)
    # where bf16 is the slower one, the best peak is float32's
    assert e2e.mfu(side, {"fp32": 200.0, "bf16": 20.0}, 1e9)["update_mfu_vs_best_peak"] == pytest.approx(1.5)


def test_summarize_reports_mfu_per_side_with_peaks():
    def side(wall):
        return {"wall_s": wall, "tokens": 100, "response_tokens": 1, "phases": {"update": wall / 2}}

    rounds = [{"trl": side(4.0), "hybridflow_ray": side(2.0), "peaks_gflops": {"fp32": 100.0, "bf16": 400.0}}
              for _ in range(3)]
    s = e2e.summarize(rounds, forward_flops=1e9)
    assert set(s["sides"]) == {"trl", "hybridflow_ray"}
    assert s["peaks_gflops"]["bf16"]["median"] == 400.0
    # hybridflow: 3e11 FLOP in 1 s = 300 GFLOP/s = 3.0 of fp32's 100, 0.75 of bf16's 400
    assert s["sides"]["hybridflow_ray"]["mfu"]["update_mfu_vs_fp32_peak"]["median"] == pytest.approx(3.0)
    assert s["sides"]["hybridflow_ray"]["mfu"]["update_mfu_vs_best_peak"]["median"] == pytest.approx(0.75)
    assert s["sides"]["trl"]["mfu"]["update_mfu_vs_best_peak"]["median"] == pytest.approx(0.375)
