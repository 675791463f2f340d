"""bench/async_sim.py: the discrete-event projection of sync / ahead / stream schedules. Timelines
worked out by hand where the lengths are equal; orderings and invariants where they are not."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from bench import async_sim as sim
from bench.async_sim import UNBOUNDED, Costs, Lengths, Schedule, Workload

EQUAL = Lengths(empirical=(10,), max_tokens=10)
TAIL = Lengths(median_tokens=60, sigma=1.2, max_tokens=2000)
# a GPU-like engine: a decode step costs 20 ms whatever its rows (flat), plus 0.1 ms per row
FLAT = Costs(step_base_s=0.02, step_per_row_s=1e-4, train_s_per_token=2e-3, sync_s=0.5, chunk_tokens=8)


def test_equal_lengths_ahead_overlaps_ideally_and_sync_not_at_all():
    # 4 prompts × 2 samples × 10 tokens = 80 tokens per batch; a step costs 0.1 s per row, nothing fixed.
    # One engine: 80 row-steps · 0.1 s = 8 s per batch; training 80 · 0.1 s = 8 s on one device.
    w = Workload(4, 2, 0, EQUAL, iterations=20, warmup_iterations=2)
    c = Costs(step_base_s=0.0, step_per_row_s=0.1, train_s_per_token=0.1)
    sync1 = sim.simulate(Schedule("sync", 1), c, w)
    ahead = sim.simulate(Schedule("ahead", 2, 1, 1), c, w)
    # sync on 1 device: 8 s generating, then 8 s training, every iteration: no overlap
    assert sync1.iteration_s == pytest.approx(16.0)
    assert sync1.trainer_idle_share == pytest.approx(0.5) and sync1.generator_idle_share == pytest.approx(0.5)
    # ahead on 1 + 1: after the first batch (8 s) the two sides run side by side, one batch per 8 s
    assert ahead.iteration_s == pytest.approx(8.0)
    assert ahead.wall_s == pytest.approx(8.0 + 20 * 8.0)
    # each side waits only 8 s of 168: the trainer for the first batch, the generator during the last update
    assert ahead.trainer_idle_share == pytest.approx(8 / 168)
    assert ahead.generator_idle_share == pytest.approx(8 / 168)
    # on the same 2 devices sync splits each phase in two: 4 s + 4 s, the same 8 s per iteration as
    # ahead's overlap (gen = train, perfect scaling: nothing left for the overlap to win)
    sync2 = sim.simulate(Schedule("sync", 2), c, w)
    assert sync2.iteration_s == pytest.approx(8.0) and sync2.trainer_idle_share == pytest.approx(0.5)


def test_ahead_with_shared_cores_runs_each_side_at_its_speed():
    # the same batches, each side at half speed: gen 16 s, train 16 s (+ 1 s fixed, + 0.5 s sync unscaled)
    w = Workload(4, 2, 0, EQUAL, iterations=10)
    c = Costs(step_base_s=0.0, step_per_row_s=0.1, train_s_per_token=0.1, train_fixed_s=1.0, sync_s=0.5)
    r = sim.simulate(Schedule("ahead", 2, 1, 1, gen_speed=(0.5, 0.5), train_speed=(0.5, 0.5)), c, w)
    assert r.iteration_s == pytest.approx(17.5)
    # a side alone at full speed: the trainer's fixed 1 s and sync 0.5 s are wall seconds; while the
    # generator is busy the trainer trains at half speed, so an iteration is at most 17.5 s and more than 9.5 s
    free = sim.simulate(Schedule("ahead", 2, 1, 1, gen_speed=(1.0, 0.5), train_speed=(1.0, 0.5)), c, w)
    assert 9.5 < free.iteration_s < 17.5


def test_stream_timeline_by_hand():
    # 1 prompt × 1 sample of 10 tokens per update, k = 1 so 2 groups in flight; one engine at 0.1 s
    # per row per step, training 10 tokens · 0.2 s = 2 s on one device.
    w = Workload(1, 1, 0, EQUAL, iterations=5, warmup_iterations=2)
    c = Costs(step_base_s=0.0, step_per_row_s=0.1, train_s_per_token=0.2)
    r = sim.simulate(Schedule("stream", 2, 1, 1), c, w)
    # t 0: groups 0 and 1 start together (0.2 s a step) and finish at 2 s; group 0 trains 2 → 4 s.
    # t 4: version 1 published, group 2 starts alone (0.1 s a step, done at 5 s), group 1 (version 0,
    # staleness 1) trains 4 → 6 s; then every 2 s the same: updates end at 4, 6, 8, 10, 12 s.
    assert r.wall_s == pytest.approx(12.0) and r.iteration_s == pytest.approx(2.0)
    assert r.tokens_per_s == pytest.approx(30 / 6)
    assert r.staleness_hist == {0: 1, 1: 4} and r.trained_groups == [0, 1, 2, 3, 4]
    assert r.trainer_idle_share == pytest.approx(2 / 12)
    # the engine decodes 0 → 2 s, then 1 s of every 2 s: 6 s of 12
    assert r.generator_idle_share == pytest.approx(0.5)
    assert r.regenerated_groups == 0 and r.interrupted_rows == 0 and r.groups_started == 6


def test_stream_partial_rollout_by_hand():
    # rows of 30 tokens, 0.1 s per row per step, weights land every 5 steps, a prefix token re-prefilled
    # costs 0.01 s; training 30 tokens · 0.08 s = 2.4 s
    w = Workload(1, 1, 0, Lengths(empirical=(30,), max_tokens=30), iterations=3)
    c = Costs(step_base_s=0.0, step_per_row_s=0.1, train_s_per_token=0.08, prefill_s_per_token=0.01, chunk_tokens=5)
    r = sim.simulate(Schedule("stream", 2, 1, 1), c, w)
    # groups 0, 1 together: 30 steps · 0.2 s = 6 s; group 0 trains 6 → 8.4 s (v1); group 2 starts
    # alone at 8.4 s, group 1 trains 8.4 → 10.8 s (v2). At 10.8 s group 2 is at step 24: v2 lands at
    # step 25 (10.9 s), its 25-token prefix re-prefilled (0.25 s); group 3, submitted at 10.8 s,
    # waited for those weights and starts beside it: 5 steps · 0.2 s, group 2 done at 12.15 s
    # (oldest token v1, trainer at v2: staleness 1) and trained 12.15 → 14.55 s.
    assert r.wall_s == pytest.approx(14.55)
    assert r.interrupted_rows == 1 and r.regenerated_groups == 0
    assert r.staleness_hist == {0: 1, 1: 2} and r.trained_groups == [0, 1, 2]


def test_equal_lengths_stream_gains_nothing_over_ahead():
    w = Workload(16, 4, 20, EQUAL, iterations=8)
    res = {r.mode: r for r in sim.compare([Schedule("sync", 4), Schedule("ahead", 4, 2, 1),
                                           Schedule("stream", 4, 2, 1)], FLAT, w)}
    assert res["stream"].tokens_per_s == pytest.approx(res["ahead"].tokens_per_s, rel=0.05)
    assert res["stream"].regenerated_groups == 0


def test_long_tail_on_a_flat_step_orders_stream_ahead_sync():
    w = Workload(32, 4, 20, TAIL, iterations=8)
    res = {r.mode: r for r in sim.compare([Schedule("sync", 8), Schedule("ahead", 8, 4, 1),
                                           Schedule("stream", 8, 4, 1)], FLAT, w)}
    assert res["sync"].ratio_to_sync == 1.0
    assert res["stream"].tokens_per_s > 1.2 * res["ahead"].tokens_per_s
    assert res["ahead"].tokens_per_s > 1.05 * res["sync"].tokens_per_s
    # the tail: sync's engines sit idle beside the longest row, stream's stay busy
    assert res["stream"].generator_idle_share < res["sync"].generator_idle_share


@pytest.mark.parametrize("k", [0, 1, 2])
def test_ahead_staleness_is_at_most_k(k):
    w = Workload(8, 4, 0, TAIL, iterations=10)
    r = sim.simulate(Schedule("ahead", 4, 2, k), FLAT, w)
    assert max(r.staleness_hist) == k and sum(r.staleness_hist.values()) == 8 * 10
    # iteration j generates with version max(0, j − 1 − k): the first k batches are less stale
    assert r.staleness_hist[k] == 8 * (10 - k)


def test_stream_regenerates_groups_older_than_the_bound():
    w = Workload(16, 4, 20, TAIL, iterations=8)
    # k = 0 with hybridflow's default bound (k + 1)·B = B in flight: a take needs every group in
    # flight, all started after the last publish: nothing stale, nothing interrupted
    exact = sim.simulate(Schedule("stream", 4, 2, 0), FLAT, w)
    assert exact.regenerated_groups == 0 and exact.interrupted_rows == 0 and exact.staleness_hist == {0: 128}
    # 3·B in flight with k = 0: groups started before an update finish after it and are generated again
    tight = sim.simulate(Schedule("stream", 4, 2, 0, max_inflight_groups=48), FLAT, w)
    assert tight.regenerated_groups > 0 and tight.staleness_hist == {0: 128}
    assert tight.interrupted_rows > 0  # partial rollouts: unfinished rows crossed a weight change
    # no bound: the same groups are trained however old, none generated again
    loose = sim.simulate(Schedule("stream", 4, 2, UNBOUNDED, max_inflight_groups=48), FLAT, w)
    assert loose.regenerated_groups == 0 and max(loose.staleness_hist) > 0


def _group_tokens(w: Workload, g: int) -> int:
    return int(w.group_lengths(0, g).sum()) + w.samples_per_prompt * w.prompt_tokens


@pytest.mark.parametrize("schedule", [Schedule("sync", 4), Schedule("ahead", 4, 2, 1),
                                      Schedule("stream", 4, 2, UNBOUNDED), Schedule("stream", 4, 2, 1)])
def test_tokens_are_conserved(schedule):
    w = Workload(16, 4, 20, TAIL, iterations=6)
    r = sim.simulate(schedule, FLAT, w)
    assert len(r.trained_groups) == len(set(r.trained_groups)) == 16 * 6  # none trained twice
    if schedule.mode != "stream":
        assert sorted(r.trained_groups) == list(range(96))
        assert r.trained_tokens == sum(_group_tokens(w, g) for g in range(96))
        return
    # none lost: every group started is trained or still in flight, within the in-flight bound
    assert set(r.trained_groups) <= set(range(r.groups_started))
    assert 0 <= r.groups_started - len(r.trained_groups) <= (schedule.max_staleness + 1 if
                                                             schedule.max_staleness < UNBOUNDED else 2) * 16
    if schedule.max_staleness == UNBOUNDED:  # no regeneration: each group trained as first drawn
        assert r.trained_tokens == sum(_group_tokens(w, g) for g in r.trained_groups)


def test_same_seed_same_result_other_seed_other_result():
    w = Workload(16, 4, 20, TAIL, iterations=6)
    s = Schedule("stream", 4, 2, 1)
    a, b, c = (sim.simulate(s, FLAT, w, seed) for seed in (3, 3, 4))
    assert a.summary() == b.summary() and a.trained_groups == b.trained_groups
    assert a.summary() != c.summary()


def test_lengths_draw_is_capped_and_empirical():
    import numpy as np

    rng = np.random.default_rng(0)
    x = Lengths(median_tokens=100, sigma=3.0, max_tokens=500).draw(rng, 1000)
    assert x.min() >= 1 and x.max() == 500
    assert set(Lengths(empirical=(3, 7), max_tokens=10).draw(rng, 50)) <= {3, 7}


def test_a_schedule_without_devices_on_a_side_is_refused():
    w = Workload(4, 2, 0, EQUAL, iterations=3)
    with pytest.raises(ValueError, match="one generation and one training device"):
        sim.simulate(Schedule("ahead", 2, 2, 1), FLAT, w)


def _fake_async_json(tmp_path):
    """A bench/results/async.json in miniature: the demo configs (4 prompts × 8 samples; sync 2
    threads, async pools 1 thread each), 320 tokens per iteration (10 a row), sync gen 10 s + update
    20 s in a 32 s iteration (2 s overhead), async old log-probs 4 s and weight sync 1 s."""
    def it(i, wall, gen, update, olp=0.0, ws=0.0):
        return {"iteration": i, "wall_s": wall, "tokens": 320.0, "tokens_per_s": 320.0 / wall,
                "phases_s": {"gen": gen, "old_log_probs": olp, "reward": 0.1, "adv": 0.0, "update_actor": update,
                             "weight_sync": ws}}

    def med(x):
        return {"min": x, "median": x, "max": x, "n": 3}

    def summ(wall, gen, update, olp, ws):
        return {"wall_s": med(wall), "tokens_per_s": med(320.0 / wall),
                "phases_s": {"gen": med(gen), "update_actor": med(update), "old_log_probs": med(olp),
                             "weight_sync": med(ws)}}

    res = {"benchmark": "async", "environment": {"cpu": "fake", "cores": 2, "date": "today"},
           "configs": {"sync": "examples/grpo_arith.yaml", "async": "examples/grpo_arith_async.yaml"},
           "variants": {"fake": {
               "runs": {"sync": {"iterations": [it(i, 32.0, 10.0, 20.0) for i in (2, 3, 4)]},
                        "async": {"iterations": [it(i, 20.0, 6.0, 12.0, 4.0, 1.0) for i in (2, 3, 4)]}},
               "summary": {"sync": summ(32.0, 10.0, 20.0, 0.0, 0.0), "async": summ(20.0, 6.0, 12.0, 4.0, 1.0)},
               "ratio_async_to_sync": {"tokens_per_s": 1.6}},
               "no async run": {"runs": {"sync": {}}, "summary": {"sync": {}}}}}
    path = tmp_path / "async.json"
    path.write_text(json.dumps(res))
    return path


def test_calibrate_reads_the_measurement_and_predicts_the_ratio(tmp_path):
    cal = sim.calibrate(_fake_async_json(tmp_path), seed=0, iterations=12)
    assert list(cal["variants"]) == ["fake"]  # a variant without an async run is skipped
    v = cal["variants"]["fake"]
    assert v["settings"]["prompts_per_iteration"] == 4 and v["settings"]["samples_per_prompt"] == 8
    assert v["settings"]["tokens_per_row"] == 10
    assert (v["settings"]["gen_speed"], v["settings"]["train_speed"]) == (0.5, 0.5)  # 1 thread of 2
    assert v["parameters"]["overhead_s"] == pytest.approx(32.0 - 10.0 - 20.0)
    # sync: 10 + 20 + 2 = 32 s an iteration; ahead at half speed: gen 20 s, trainer 2 + 4 + 40 + 1 = 47 s
    assert v["sync"]["iteration_s"] == pytest.approx(32.0)
    assert v["predicted"]["ratio"] == pytest.approx(32.0 / 47.0)
    assert v["predicted"]["relative_error"] == pytest.approx(32.0 / 47.0 / 1.6 - 1)
    assert v["predicted"]["within_15pct"] is False
    # the schedule check uses the async run's own phases: max(6, 2 + 4 + 12 + 1) = 19 s
    assert v["schedule_check"]["ratio"] == pytest.approx(32.0 / 19.0)
    assert v["schedule_check"]["within_15pct"] is True
    assert v["predicted"]["ratio"] <= v["predicted_alone_full_speed"]["ratio"] <= 1.0


def test_main_calibrate_writes_json_and_renders(tmp_path):
    out = tmp_path / "async_sim.json"
    argv = ["--scenario", "calibrate", "--async-json", str(_fake_async_json(tmp_path)), "--out", str(out), "--no-docs"]
    assert sim.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["benchmark"] == "async_sim" and res["environment"]["cpu"]
    assert "gpu" not in res and res["calibrate"]["variants"]["fake"]["measured"]["ratio"] == 1.6
    text = sim.render(res)
    assert "| fake |" in text and "**no**" in text


def test_gpu_scenario_renders_every_device_count():
    p = replace(sim.GPU, prompts_per_iteration=16, samples_per_prompt=4, devices=(4, 8), iterations=4,
                lengths=TAIL)
    g = sim.gpu(0, p=p)
    assert [(r["devices"], r["mode"]) for r in g["rows"]] == [
        (d, m) for d in (4, 8) for m in ("sync", "ahead", "stream", "stream")]
    assert all(r["ratio_to_sync"] > 0 for r in g["rows"])
    res = {"environment": {"date": "today", "cpu": "fake", "cores": 2}, "seed": 0, "elapsed_s": 0.1, "gpu": g}
    text = sim.render(res)
    assert "| 8 | stream, k=1 | 4:4 |" in text and "2.66× at 32 GPUs" in text
