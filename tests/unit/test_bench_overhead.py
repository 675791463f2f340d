"""bench/overhead.py: attributing Ray task events to an iteration, the summary, and one smoke run
of the real machinery (Prefect server + Ray + pools) on a tiny model. No speed is asserted."""

from __future__ import annotations

import json

import pytest

from bench import overhead


def _ev(cat, name, pid, ts_s, dur_s):
    return {"cat": cat, "name": name, "pid": pid, "ts": ts_s * 1e6, "dur": dur_s * 1e6}


def test_actor_times_sums_executions_inside_the_window():
    events = [
        _ev("task::WorkerHost.call", "call", 1, 100.0, 5.0),   # generate: 5 s, of which 4.5 s executing
        _ev("task:execute", "task:execute", 1, 100.2, 4.5),
        _ev("task::WorkerHost.call", "call", 2, 106.0, 1.0),   # reward: 1 s, 0.75 s executing
        _ev("task:execute", "task:execute", 2, 106.1, 0.75),
        _ev("task::WorkerHost.ping", "ping", 1, 105.5, 0.25),
        _ev("task::WorkerHost.call", "call", 1, 300.0, 9.0),   # another iteration's call
        _ev("task:execute", "task:execute", 1, 300.1, 8.0),
    ]
    got = overhead.actor_times(overhead.tag_execute_events(events), 99.0, 110.0)
    # compute 4.5 + 0.75 = 5.25; actor-call overhead (5 + 1) − 5.25 + ping 0.25 = 1.0
    assert got == pytest.approx({"compute": 5.25, "actor_call_overhead": 1.0})


def test_summarize_overhead_fraction():
    def it(wall, compute):
        return {"wall_s": wall, "compute": compute, "actor_call_overhead": 0.5, "storage_s": 0.5,
                "new_node_processes": 1}

    s = overhead.summarize([it(10.0, 9.0), it(20.0, 10.0), it(8.0, 6.0)])
    # (10−9)/10 = 0.1, (20−10)/20 = 0.5, (8−6)/8 = 0.25
    assert s["overhead_fraction"] == {"min": 0.1, "median": 0.25, "max": 0.5, "n": 3}
    # rest = wall − compute − 0.5 − 0.5: 0, 9, 1 → median 1
    assert s["other_s"] == 1.0 and s["compute_s"] == 9.0


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_overhead_smoke_tiny(tmp_path):
    out = tmp_path / "overhead.json"
    argv = ["--model", "tiny", "--prompts-per-step", "2", "--samples-per-prompt", "2", "--max-response-tokens", "3",
            "--mini", "4", "--micro", "2", "--threads", "1", "--repeats", "1", "--warmup-rounds", "0", "--out", str(out), "--no-docs"]
    assert overhead.main(argv) == 0
    res = json.loads(out.read_text())
    iters = res["variants"]["default Ray"]["iterations"]
    assert [i["runner"] for i in iters] == ["ray", "thread"]
    for i in iters:
        assert 0 < i["compute"] < i["wall_s"]
    assert set(res["variants"]["default Ray"]["summary"]) == {"ray", "thread"}
