"""Issue 18, live progress: what workers report (workers/progress.py), how the HF engine and the
update loop count, and how the console shows it (a fake reporter and real progress files)."""

from __future__ import annotations

import io
import json
import os
import time

import pytest
import torch

from hybridflow.models import build_tiny_model, build_tiny_tokenizer
from tests.unit._worker_helpers import prompt_batch, tiny_cfg, with_advantages
from workers.progress import (
    NO_PROGRESS,
    Countdown,
    FileProgress,
    PhaseProgress,
    ProgressSink,
    read_progress,
    summarize,
)
from workers.rollout.base import SamplingParams
from workers.rollout.finished_rows import FinishedRows
from workers.rollout.hf import HFRolloutEngine

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/unit/conftest.py


class Recorder(ProgressSink):
    def __init__(self):
        self.reports: list[tuple[str, int, int]] = []

    def report(self, phase, done, total):
        self.reports.append((phase, done, total))


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _record(tmp_path, name):
    return json.loads((tmp_path / "progress" / name).read_text())


# ---- the reporter --------------------------------------------------------------------------------


def test_file_progress_throttles_but_always_writes_the_final_count(tmp_path):
    clock = FakeClock()
    sink = FileProgress(str(tmp_path / "progress"), "main", 1, min_interval_s=0.5, clock=clock)
    sink.report("generating", 1, 8)  # first report: written
    assert _record(tmp_path, "main.1.generating.json")["done"] == 1
    clock.now = 0.2
    sink.report("generating", 3, 8)  # 0.2 s later: dropped
    assert _record(tmp_path, "main.1.generating.json")["done"] == 1
    clock.now = 0.3
    sink.report("generating", 8, 8)  # the final count is never dropped
    rec = _record(tmp_path, "main.1.generating.json")
    assert (rec["done"], rec["total"], rec["pool"], rec["rank"]) == (8, 8, "main", 1)
    sink.report("updating policy", 1, 4)  # another phase has its own clock and file
    assert _record(tmp_path, "main.1.updating-policy.json")["phase"] == "updating policy"
    clock.now = 0.9
    sink.report("generating", 2, 8)  # ≥ 0.5 s after the last write: written
    assert _record(tmp_path, "main.1.generating.json")["done"] == 2
    assert not [p for p in os.listdir(tmp_path / "progress") if p.endswith(".tmp")]


def test_a_reporter_that_cannot_write_switches_itself_off(tmp_path):
    blocker = tmp_path / "progress"
    blocker.write_text("a file where the folder should be")
    sink = FileProgress(str(blocker), "main", 0)
    sink.report("generating", 1, 2)  # no exception: training goes on
    assert sink.disabled
    sink.report("generating", 2, 2)
    NO_PROGRESS.report("generating", 1, 2)
    NO_PROGRESS.tick("updating policy")(1, 2)


def test_read_progress_sums_ranks_and_keeps_only_recent_phases(tmp_path):
    folder = tmp_path / "progress"
    for rank, (done, total) in enumerate([(3, 8), (5, 8)]):
        FileProgress(str(folder), "main", rank).report("generating", done, total)
    FileProgress(str(folder), "main", 0).report("updating policy", 2, 4)
    (folder / "main.9.generating.json").write_text('{"phase": "generat')  # half-written: skipped
    phases = read_progress(str(tmp_path))
    assert [(p.phase, p.done, p.total) for p in phases] == [("generating", 8, 16), ("updating policy", 2, 4)]
    assert read_progress(str(tmp_path), since=phases[-1].updated + 1) == []
    assert read_progress(str(tmp_path / "nothing-here")) == []


def test_a_pool_rank_reports_beside_its_runs_checkpoints_and_only_there(tmp_path):
    from workers.progress import progress_for_run

    sink = progress_for_run(str(tmp_path / "run-1" / "checkpoints"), "main", 2)
    sink.report("generating", 1, 1)
    assert (tmp_path / "run-1" / "progress" / "main.2.generating.json").exists()
    assert progress_for_run(None, "main", 0) is NO_PROGRESS  # eval / node-run pools
    assert progress_for_run("s3://bucket/runs/x/checkpoints", "main", 0) is NO_PROGRESS


def test_summarize_orders_phases_by_their_last_report():
    recs = [{"phase": "updating policy", "done": 1, "total": 2, "t": 30.0},
            {"phase": "generating", "done": 4, "total": 4, "t": 10.0},
            {"phase": "generating", "done": 4, "total": 4, "t": 12.0}]
    assert summarize(recs) == [PhaseProgress("generating", 8, 8, 12.0), PhaseProgress("updating policy", 1, 2, 30.0)]


def test_countdown_reports_each_unit_and_stays_silent_without_work():
    seen = []
    c = Countdown(lambda d, t: seen.append((d, t)), 3)
    for _ in range(3):
        c.advance()
    assert seen == [(1, 3), (2, 3), (3, 3)]
    Countdown(lambda d, t: seen.append((d, t)), 0).advance()  # a padding rank: nothing to report
    assert len(seen) == 3


# ---- the HF engine -------------------------------------------------------------------------------


def test_finished_rows_counts_rows_that_stopped_and_never_stops_generation():
    seen = []
    counter = FinishedRows((2, 7), lambda d, t: seen.append((d, t)), offset=4, total=10)
    ids = torch.tensor([[5, 1], [5, 2], [5, 3]])  # row 1 just produced stop token 2
    assert not counter(ids, torch.zeros(3, 9)).any()
    ids = torch.cat([ids, torch.tensor([[7], [0], [4]])], 1)  # row 0 stops; row 1 is padding after its stop
    assert not counter(ids, torch.zeros(3, 9)).any()
    ids = torch.cat([ids, torch.tensor([[1], [0], [4]])], 1)  # nobody new: no report
    counter(ids, torch.zeros(3, 9))
    assert seen == [(5, 10), (6, 10)]


def test_hf_engine_reports_trajectories_without_changing_them():
    tok = build_tiny_tokenizer()
    model = build_tiny_model(len(tok), hidden_size=32, layers=2, seed=0).eval()
    enc = tok(["hi", "hello there", "xyz"], return_tensors="pt", padding=True)
    stops = (2, *tok.convert_tokens_to_ids(list("abcde")))
    sampling = SamplingParams(max_new_tokens=16, stop_token_ids=stops, n=4, seed=3)
    engine = HFRolloutEngine(model, tok, generation_batch_trajectories=5)
    plain = engine.generate(enc["input_ids"], enc["attention_mask"].bool(), sampling)
    seen = []
    watched = engine.generate(enc["input_ids"], enc["attention_mask"].bool(), sampling,
                              progress=lambda d, t: seen.append((d, t)))
    assert torch.equal(plain.response_ids, watched.response_ids) and plain.finish_reason == watched.finish_reason
    assert {t for _, t in seen} == {12}
    done = [d for d, _ in seen]
    assert done == sorted(done) and done[-1] == 12
    assert (5, 12) in seen and (10, 12) in seen  # after each chunk of 5 rows
    stopped_in_first_chunk = sum(r == "stop" for r in plain.finish_reason[:5])
    assert stopped_in_first_chunk > 0 and (stopped_in_first_chunk, 12) in seen  # counted as rows stopped


# ---- the workers ---------------------------------------------------------------------------------


def test_policy_worker_reports_generation_and_micro_batches():
    from workers.policy import PolicyWorker

    worker = PolicyWorker(tiny_cfg("actor.ppo_epochs=2"))
    assert worker.progress is NO_PROGRESS  # built outside a pool: nothing is written anywhere
    worker.progress = rec = Recorder()
    batch = worker.generate_sequences(prompt_batch(worker.tokenizer), seed=1)
    gen = [r for r in rec.reports if r[0] == "generating"]
    assert gen[-1] == ("generating", 4, 4)  # 2 prompts × 2 samples
    worker.generate_sequences(prompt_batch(worker.tokenizer), seed=1, validate=True)
    assert rec.reports[-1][0] == "validating"
    rec.reports.clear()
    worker.update_policy(with_advantages(worker.compute_log_probs(batch)), expected_version=0, batch_id="b0")
    # 4 rows, mini-batches of 4, micro-batches of 2, 2 epochs: 2 × 1 × 2 = 4 micro-batches
    assert rec.reports == [("updating policy", i, 4) for i in (1, 2, 3, 4)]


# ---- the console ---------------------------------------------------------------------------------


def _render(con) -> str:
    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=120).print(con)
    return buf.getvalue()


def test_live_display_shows_the_phases_a_fake_reporter_gives():
    from flows.console import RunConsole

    asked = []

    def fake(since):
        asked.append(since)
        return [PhaseProgress("generating", 32, 32, 1.0), PhaseProgress("updating policy", 3, 8, 2.0)]

    con = RunConsole("r1", "/nonexistent", 5, stream=io.StringIO(), live=True, progress=fake)
    ended = time.time()
    con.iteration_done(1, {"critic/score/mean": 0.25})
    text = _render(con)
    assert "generating: trajectories 32/32  done" in text
    assert "updating policy: micro-batch 3/8" in text and "3/8  done" not in text
    assert "iteration 2/5" in text and "score 0.250" in text
    assert ended <= asked[-1] <= time.time()  # asked for what was reported after the iteration ended
    validated = time.time()
    con.validation_done(1, {"val-core/arith/acc/mean@1": 0.5})
    _render(con)
    assert asked[-1] >= validated


def test_live_display_reads_the_workers_files_and_survives_a_broken_reporter(tmp_path):
    from flows.console import RunConsole

    con = RunConsole("r1", str(tmp_path), 2, stream=io.StringIO(), live=True)
    FileProgress(str(tmp_path / "progress"), "main", 0).report("generating", 6, 16)
    assert "generating: trajectories 6/16" in _render(con)

    def broken(since):
        raise RuntimeError("boom")

    con = RunConsole("r1", str(tmp_path), 2, stream=io.StringIO(), live=True, progress=broken)
    assert "iteration 1/2" in _render(con)  # the display goes on without the phase rows


def test_plain_console_does_not_print_progress(tmp_path):
    from flows.console import RunConsole

    FileProgress(str(tmp_path / "progress"), "main", 0).report("generating", 6, 16)
    stream = io.StringIO()
    con = RunConsole("r1", str(tmp_path), 1, stream=stream)
    con.start()
    con.iteration_done(1, {"critic/score/mean": 0.5})
    con.close()
    assert len(stream.getvalue().splitlines()) == 2 and "generating" not in stream.getvalue()
