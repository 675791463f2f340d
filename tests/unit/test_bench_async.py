"""bench/async_train.py: the timed iterations of a run's metrics.jsonl, the summary and ratios, the
dedicated-device projection (hand-worked), the overrides of a run, and one smoke run of both
configurations on the tiny model. No speed is asserted."""

from __future__ import annotations

import json

import pytest

from bench import async_train as bench


def _rec(it, wall, tokens=100.0, **phases):
    m = {"timing_s/iteration_wall": wall, "perf/total_num_tokens": tokens}
    m.update({bench.PHASES[k]: v for k, v in phases.items()})
    return {"iteration": it, "metrics": m}


def test_read_iterations_keeps_timed_rows_in_order(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [_rec(2, 5.0), {"iteration": 0, "metrics": {"data/train_prompts": 8.0}}, _rec(1, 9.0), _rec(3, 4.0)]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    assert [r["iteration"] for r in bench.read_iterations(path)] == [1, 2, 3]


def test_timed_rows_drop_warmup_and_drain():
    records = [_rec(1, 9.0), _rec(2, 5.0, gen=2.0), _rec(3, 4.0), _rec(4, 1.0)]  # 4: an async run's drain
    rows = bench.timed_rows(records, iterations=3)
    assert [r["iteration"] for r in rows] == [2, 3]
    assert rows[0]["tokens_per_s"] == pytest.approx(100.0 / 5.0)
    # a phase the run does not log counts 0 s
    assert rows[0]["phases_s"]["gen"] == 2.0 and rows[0]["phases_s"]["weight_sync"] == 0.0


def test_summarize_and_ratio_of_medians():
    sync = bench.summarize(bench.timed_rows([_rec(2, 10.0, gen=4.0), _rec(3, 12.0, gen=6.0), _rec(4, 30.0, gen=5.0)], 4))
    asyn = bench.summarize(bench.timed_rows([_rec(2, 6.0, gen=8.0), _rec(3, 9.0, gen=10.0), _rec(4, 8.0, gen=12.0)], 4))
    assert sync["wall_s"] == {"min": 10.0, "median": 12.0, "max": 30.0, "n": 3}
    r = bench.ratios(sync, asyn)
    # wall 8 / 12; tokens/s medians 100/8 = 12.5 over 100/12 → 1.5; gen 10 / 5 = 2
    assert r["wall_s"] == pytest.approx(8 / 12) and r["tokens_per_s"] == pytest.approx(1.5)
    assert r["gen"] == pytest.approx(2.0)
    assert r["weight_sync"] is None  # the sync run has no weight sync


def _summary(wall, **phases):
    s = bench.summarize([bench.iteration_row(_rec(2, wall, **phases))])
    return s


def test_expected_speedup_hand_worked():
    sync = _summary(34.0, gen=10.0, reward=1.0, adv=0.0, update_actor=20.0)
    asyn = _summary(50.0, gen=18.0, reward=1.0, old_log_probs=10.0, update_actor=40.0, weight_sync=2.0)
    e = bench.expected_speedup(sync, asyn)
    # train = 1 + 0 + 20 = 21; overhead = 34 − 10 − 21 = 3; old log-probs at 2 threads = 10 · 20/40 = 5
    # one-step-off = max(10, 5 + 21 + 2) + 3 = 31 → 34 / 31; bound (10 + 21) / max(10, 21) = 31 / 21
    assert e["train_s"] == 21.0 and e["overhead_s"] == 3.0 and e["old_log_probs_s"] == 5.0
    assert e["one_step_off_s"] == 31.0
    assert e["speedup"] == pytest.approx(34 / 31) and e["bound"] == pytest.approx(31 / 21)
    # generation-bound: gen 40 hides the trainer's 28 → max(40, 28) + 3 = 43 against 40 + 21 + 3 = 64
    e = bench.expected_speedup(_summary(64.0, gen=40.0, reward=1.0, update_actor=20.0), asyn)
    assert e["one_step_off_s"] == 43.0 and e["speedup"] == pytest.approx(64 / 43)


def test_run_overrides_add_a_drain_iteration_for_async_only():
    sync = dict(x.split("=", 1) for x in bench.run_overrides("sync", 5, "/r", "/t.parquet", {"model.path": "tiny"}))
    asyn = dict(x.split("=", 1) for x in bench.run_overrides("async", 5, "/r", "/t.parquet", {}))
    assert sync["trainer.total_iterations"] == "5" and asyn["trainer.total_iterations"] == "6"
    assert sync["trainer.val_every"] == "0" and sync["trainer.val_before_train"] == "false"
    assert sync["model.path"] == "tiny" and sync["data.train_files"] == "[/t.parquet]"


def test_variant_argument():
    assert bench._variant("spp4=rollout.samples_per_prompt=4,rollout.max_response_tokens=96") == (
        "spp4", {"rollout.samples_per_prompt": "4", "rollout.max_response_tokens": "96"})
    with pytest.raises(Exception, match="NAME=KEY=VALUE"):
        bench._variant("just-a-name")


@pytest.mark.integration
@pytest.mark.timeout(1200)
def test_async_bench_smoke_tiny(tmp_path):
    out = tmp_path / "async.json"
    argv = ["--iterations", "2", "--no-default-variants", "--variant", "tiny=rollout.samples_per_prompt=2",
            "--extra", "model.path=tiny", "--extra", "data.prompts_per_iteration=2",
            "--extra", "rollout.max_response_tokens=3", "--extra", "actor.mini_batch_trajectories=4",
            "--extra", "actor.micro_batch_trajectories=2", "--out", str(out), "--no-docs"]
    assert bench.main(argv) == 0
    res = json.loads(out.read_text())
    v = res["variants"]["tiny"]
    assert v["order"] == ["sync", "async"]
    for config in ("sync", "async"):
        rows = v["runs"][config]["iterations"]
        assert [r["iteration"] for r in rows] == [2]
        assert rows[0]["wall_s"] > 0 and rows[0]["tokens"] > 0 and rows[0]["phases_s"]["update_actor"] > 0
    assert v["runs"]["async"]["iterations"][0]["phases_s"]["weight_sync"] > 0
    assert v["runs"]["async"]["iterations"][0]["staleness_mean"] == 1.0  # one-step-off
    assert v["runs"]["sync"]["iterations"][0]["phases_s"]["weight_sync"] == 0.0
    assert set(v["ratio_async_to_sync"]) == {"wall_s", "tokens_per_s", *bench.PHASES}
    assert v["expected_dedicated"]["speedup"] > 0
    assert len(res["load_avg_before"]) == len(res["load_avg_after"]) == 3
    text = bench.render(res)
    assert "| tiny | async ÷ sync |" in text and "expected speedup" in text


def test_from_runs_reads_two_run_folders(tmp_path):
    for config, walls in (("sync", [9.0, 6.0, 8.0, 7.0]), ("async", [8.0, 5.0, 4.0, 3.0])):
        d = tmp_path / config
        d.mkdir()
        (d / "metrics.jsonl").write_text("\n".join(
            json.dumps(_rec(i + 1, w, gen=1.0, update_actor=2.0, weight_sync=0.5 if config == "async" else 0.0))
            for i, w in enumerate(walls)))
    v = bench.from_runs(tmp_path / "sync", tmp_path / "async", iterations=3)
    assert v["timed_iterations"] == "2..3"
    assert [r["iteration"] for r in v["runs"]["async"]["iterations"]] == [2, 3]
    # medians: sync (6 + 8) / 2 = 7, async (5 + 4) / 2 = 4.5
    assert v["ratio_async_to_sync"]["wall_s"] == pytest.approx(4.5 / 7.0)
    with pytest.raises(ValueError, match="no iterations"):
        bench.from_runs(tmp_path / "sync", tmp_path / "async", iterations=1)
    late = bench.from_runs(tmp_path / "sync", tmp_path / "async", iterations=4, first=3)
    assert late["timed_iterations"] == "3..4" and late["summary"]["sync"]["wall_s"]["median"] == 7.5
    assert bench._range("12..19") == (12, 19)
    with pytest.raises(Exception, match="FIRST..LAST"):
        bench._range("19..12")
