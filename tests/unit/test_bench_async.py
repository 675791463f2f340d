"""bench/async_train.py: the timed iterations of a run's metrics.jsonl, the summary and ratios, the
dedicated-device projection (hand-worked), the overrides of a run, the three configurations (sync,
async, stream) side by side and variants that lack one, the command line (--configs, --from-runs),
and smoke runs on the tiny model (sync and async; stream in a slow test). No speed is asserted."""

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


def test_run_overrides_add_a_drain_iteration_for_async_and_stream():
    sync = dict(x.split("=", 1) for x in bench.run_overrides("sync", 5, "/r", "/t.parquet", {"model.path": "tiny"}))
    asyn = dict(x.split("=", 1) for x in bench.run_overrides("async", 5, "/r", "/t.parquet", {}))
    stream = dict(x.split("=", 1) for x in bench.run_overrides("stream", 5, "/r", "/t.parquet", {}))
    assert sync["trainer.total_iterations"] == "5" and asyn["trainer.total_iterations"] == "6"
    assert stream["trainer.total_iterations"] == "6" and stream["trainer.run_id"] == "stream"
    assert sync["trainer.val_every"] == "0" and sync["trainer.val_before_train"] == "false"
    assert sync["model.path"] == "tiny" and sync["data.train_files"] == "[/t.parquet]"


def test_variant_argument():
    assert bench._variant("spp4=rollout.samples_per_prompt=4,rollout.max_response_tokens=96") == (
        "spp4", {"rollout.samples_per_prompt": "4", "rollout.max_response_tokens": "96"})
    with pytest.raises(Exception, match="NAME=KEY=VALUE"):
        bench._variant("just-a-name")


TINY_ARGV = ["--iterations", "2", "--no-default-variants", "--variant", "tiny=rollout.samples_per_prompt=2",
             "--extra", "model.path=tiny", "--extra", "data.prompts_per_iteration=2",
             "--extra", "rollout.max_response_tokens=3", "--extra", "actor.mini_batch_trajectories=4",
             "--extra", "actor.micro_batch_trajectories=2", "--no-docs"]


@pytest.mark.integration
@pytest.mark.timeout(1200)
def test_async_bench_smoke_tiny(tmp_path):
    """sync and async only (~5 minutes on 2 busy cores); the stream configuration's plumbing is
    tested below with faked runs, and stream training itself in tests/integration/test_stream_training.py."""
    out = tmp_path / "async.json"
    assert bench.main([*TINY_ARGV, "--configs", "sync,async", "--out", str(out)]) == 0
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
    assert "stream" not in v["summary"] and "ratio_stream_to_sync" not in v


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


# ---- three configurations -----------------------------------------------------------------------


def test_stream_config_is_the_streaming_example():
    assert list(bench.CONFIGS) == ["sync", "async", "stream"]
    text = (bench.common.ROOT / bench.CONFIGS["stream"]).read_text()
    assert "async_mode: stream" in text and "max_staleness: 1" in text


def _three():
    """Summaries of one iteration each: sync 34 s, async 17 s, stream 25 s (hand-chosen phases)."""
    return {"sync": _summary(34.0, gen=10.0, reward=1.0, adv=0.0, update_actor=20.0),
            "async": _summary(17.0, gen=18.0, reward=1.0, old_log_probs=10.0, update_actor=40.0, weight_sync=2.0),
            "stream": _summary(25.0, gen=2.0, reward=1.0, old_log_probs=4.0, update_actor=10.0, weight_sync=1.0)}


def test_compare_gives_ratios_and_projection_per_overlapped_config():
    summary = _three()
    c = bench.compare(summary)
    assert set(c) == {"ratio_async_to_sync", "expected_dedicated", "ratio_stream_to_sync", "expected_dedicated_stream"}
    assert c["ratio_async_to_sync"] == bench.ratios(summary["sync"], summary["async"])
    r = c["ratio_stream_to_sync"]
    # stream ÷ sync: wall 25 / 34; tokens/s (100/25) / (100/34) = 34 / 25; gen 2 / 10; update 10 / 20
    assert r["wall_s"] == pytest.approx(25 / 34) and r["tokens_per_s"] == pytest.approx(34 / 25)
    assert r["gen"] == pytest.approx(0.2) and r["update_actor"] == pytest.approx(0.5)
    assert r["weight_sync"] is None and r["old_log_probs"] is None  # the sync run has neither
    e = c["expected_dedicated_stream"]
    # train 21, overhead 3; old log-probs at 2 threads 4 · 20/10 = 8; max(10, 8 + 21 + 1) + 3 = 33
    assert e["old_log_probs_s"] == 8.0 and e["one_step_off_s"] == 33.0 and e["speedup"] == pytest.approx(34 / 33)
    assert c["expected_dedicated"]["one_step_off_s"] == 31.0  # the async projection is unchanged
    # only what exists: no stream run → no stream keys; no sync run → nothing to compare with
    assert set(bench.compare({k: summary[k] for k in ("sync", "async")})) == {"ratio_async_to_sync",
                                                                               "expected_dedicated"}
    assert set(bench.compare({k: summary[k] for k in ("sync", "stream")})) == {"ratio_stream_to_sync",
                                                                                "expected_dedicated_stream"}
    assert bench.compare({k: summary[k] for k in ("async", "stream")}) == {}


def _res(variants, configs=("sync", "async", "stream")):
    env = {"date": "2026-01-01 00:00:00", "cpu": "test cpu", "cores": 2, "torch": "0", "torch_threads": 2,
           "load_avg": [1.0, 1.0, 1.0]}
    return {"environment": env, "iterations": 3, "load_avg_before": [1.0, 1.0, 1.0], "load_avg_after": [2.0, 2.0, 2.0],
            "train_file": "generated", "configs": {c: bench.CONFIGS[c] for c in configs}, "variants": variants}


def _table_rows(text):
    return [line for line in text.splitlines() if line.startswith("| ")]


def test_render_three_configs_side_by_side():
    summary = _three()
    text = bench.render(_res({"v": {"summary": summary, **bench.compare(summary)}}))
    rows = _table_rows(text)
    labels = [r.split(" | ")[1] for r in rows if r.startswith("| v |")]
    assert labels == ["sync", "async", "stream", "async ÷ sync", "stream ÷ sync", "async", "stream"]
    assert "| v | stream | 25.0 | 4.0 | 2.0 | 4.0 | 10.0 | 1.0 | 0.00 |" in rows
    assert f"| v | stream ÷ sync | {25 / 34:.2f} | {34 / 25:.2f} | 0.20 | — | 0.50 | — |  |" in rows
    # the projection, one row per overlapped configuration: stream 33 s → 34 / 33
    assert f"| v | stream | 10.0 | 21.0 | 8.0 | 1.0 | 3.0 | 34.0 | 33.0 | {34 / 33:.2f}× | {31 / 21:.2f}× |" in rows
    assert f"| v | async | 10.0 | 21.0 | 5.0 | 2.0 | 3.0 | 34.0 | 31.0 | {34 / 31:.2f}× | {31 / 21:.2f}× |" in rows
    assert "the async and stream runs' drain iteration 4 is cut" in text


def test_render_copes_with_variants_missing_a_config():
    summary = _three()
    two = {k: summary[k] for k in ("sync", "async")}
    no_sync = {k: summary[k] for k in ("async", "stream")}
    text = bench.render(_res({"two": {"summary": two, **bench.compare(two)},
                              "no sync": {"summary": no_sync, **bench.compare(no_sync)}}))
    rows = _table_rows(text)
    assert [r.split(" | ")[1] for r in rows if r.startswith("| two |")] == ["sync", "async", "async ÷ sync", "async"]
    assert [r.split(" | ")[1] for r in rows if r.startswith("| no sync |")] == ["async", "stream"]
    assert "stream ÷ sync" not in text
    # nothing to project from at all: no projection section
    only_stream = {"stream": summary["stream"]}
    text = bench.render(_res({"s": {"summary": only_stream, **bench.compare(only_stream)}}, configs=("stream",)))
    assert "Expected with a device each" not in text and "| s | stream | 25.0 |" in text
    assert "the stream run's drain iteration 4 is cut" in text
    text = bench.render(_res({"s": {"summary": {"sync": summary["sync"]}}}, configs=("sync",)))
    assert "drain" not in text and "| s | sync | 34.0 |" in text


def test_render_reads_a_two_config_result_file():
    """bench/results/async.json as written before the stream configuration: async rows and ratios only."""
    res = json.loads((bench.common.RESULTS_DIR / "async.json").read_text())
    text = bench.render(res)
    assert "| spp4 | async ÷ sync |" in text and "| spp4 | async | 46.7 |" in text
    assert "stream" not in text


def test_measure_alternates_three_configs_and_compares(tmp_path, monkeypatch):
    walls = {"sync": 30.0, "async": 15.0, "stream": 10.0}
    calls = []

    def fake_run(config, iterations, workdir, train_file, extra, timeout_s):
        calls.append((config, extra["rollout.samples_per_prompt"]))
        return {"iterations": [bench.iteration_row(_rec(2, walls[config], gen=1.0, update_actor=2.0))]}

    monkeypatch.setattr(bench, "run_config", fake_run)
    monkeypatch.setattr(bench, "ensure_train_file", lambda d: str(d / "train.jsonl"))
    variants = {"a": {"rollout.samples_per_prompt": "2"}, "b": {"rollout.samples_per_prompt": "4"}}
    res = bench.measure(variants, 3, {}, workdir=str(tmp_path))
    assert calls == [("sync", "2"), ("async", "2"), ("stream", "2"), ("stream", "4"), ("async", "4"), ("sync", "4")]
    assert res["variants"]["b"]["order"] == ["stream", "async", "sync"]
    assert res["configs"] == bench.CONFIGS
    v = res["variants"]["b"]
    assert list(v["summary"]) == ["sync", "async", "stream"]  # CONFIGS order, whatever the run order
    assert v["ratio_stream_to_sync"]["wall_s"] == pytest.approx(10 / 30)
    assert v["ratio_async_to_sync"]["wall_s"] == pytest.approx(15 / 30)
    calls.clear()
    res = bench.measure(variants, 3, {}, workdir=str(tmp_path), configs=["sync", "stream"])
    assert calls == [("sync", "2"), ("stream", "2"), ("stream", "4"), ("sync", "4")]
    assert set(res["configs"]) == {"sync", "stream"}
    assert "ratio_async_to_sync" not in res["variants"]["a"] and "ratio_stream_to_sync" in res["variants"]["a"]


def test_configs_argument():
    assert bench._configs("sync,async,stream") == ["sync", "async", "stream"]
    assert bench._configs(" sync , stream ") == ["sync", "stream"]
    for bad in ("", "sync,sync", "sync,ahead"):
        with pytest.raises(Exception, match="--configs takes"):
            bench._configs(bad)


def test_command_line_configs_and_from_runs(monkeypatch, tmp_path):
    seen = {}

    def fake_measure(variants, iterations, extra, **kw):
        seen.update(kw, variants=variants)
        return {}

    monkeypatch.setattr(bench, "measure", fake_measure)
    monkeypatch.setattr(bench.common, "write_result_and_render", lambda *a, **kw: {})
    monkeypatch.setattr(bench.common, "exit_cleanly_on_sigterm", lambda: None)
    assert bench.main(["--no-default-variants", "--variant", "v=a=1", "--no-docs"]) == 0
    assert seen["configs"] == ["sync", "async", "stream"]
    assert bench.main(["--configs", "sync,async", "--no-default-variants", "--variant", "v=a=1",
                       "--from-runs", "three=/s,/a,/st", "--from-runs", "two=/s,/a", "--no-docs"]) == 0
    assert seen["configs"] == ["sync", "async"]
    assert seen["runs"] == {"three": ("/s", "/a", "/st"), "two": ("/s", "/a")}
    for bad in (["--configs", "sync,turbo"], ["--from-runs", "x=/s"], ["--from-runs", "x=/s,/a,/st,/more"],
                ["--from-runs", "x=/s,,/st"]):
        with pytest.raises(SystemExit) as exc:
            bench.main(["--no-default-variants", "--variant", "v=a=1", "--no-docs", *bad])
        assert exc.value.code == 2


def test_from_runs_reads_three_run_folders(tmp_path):
    walls = {"sync": [9.0, 6.0, 8.0, 7.0], "async": [8.0, 5.0, 4.0, 3.0], "stream": [7.0, 3.0, 2.0, 1.0]}
    for config, ws in walls.items():
        d = tmp_path / config
        d.mkdir()
        (d / "metrics.jsonl").write_text("\n".join(
            json.dumps(_rec(i + 1, w, gen=1.0, update_actor=2.0, weight_sync=0.0 if config == "sync" else 0.5))
            for i, w in enumerate(ws)))
    v = bench.from_runs(tmp_path / "sync", tmp_path / "async", iterations=3, stream_dir=tmp_path / "stream")
    assert list(v["runs"]) == ["sync", "async", "stream"] and v["runs"]["stream"]["run_dir"] == str(tmp_path / "stream")
    # medians of iterations 2..3: sync 7, async 4.5, stream 2.5
    assert v["ratio_async_to_sync"]["wall_s"] == pytest.approx(4.5 / 7.0)
    assert v["ratio_stream_to_sync"]["wall_s"] == pytest.approx(2.5 / 7.0)
    assert v["expected_dedicated_stream"]["weight_sync_s"] == 0.5
    text = bench.render(_res({"runs": v}))
    assert "| runs | stream ÷ sync | 0.36 |" in text and str(tmp_path / "stream") in text
    (tmp_path / "stream" / "metrics.jsonl").write_text(json.dumps(_rec(1, 7.0)))
    with pytest.raises(ValueError, match="no iterations"):
        bench.from_runs(tmp_path / "sync", tmp_path / "async", iterations=3, stream_dir=tmp_path / "stream")
    assert bench._run_dirs("n=/s,/a,/st") == ("n", ("/s", "/a", "/st"))
    assert bench._run_dirs("n=/s,/a") == ("n", ("/s", "/a"))
