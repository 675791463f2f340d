"""RewardExecutor: rule rewards in a process pool, metrics, and user functions that raise,
return NaN/None, hang past the timeout, or kill their process (os._exit, segfault)."""

import subprocess
import sys
import textwrap
import time

import pytest

from hybridflow.config import RewardConfig
from hybridflow.rewards import (
    RewardExecutor,
    RewardItem,
    RewardLoadError,
    UnknownDataSourceError,
)

# ground_truth selects the misbehaviour, so one function covers every failure kind
BAD_REWARDS = '''
import ctypes, math, os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "sleep":
        time.sleep(60)
    if ground_truth == "exit":
        os._exit(3)
    if ground_truth == "segv":
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    if ground_truth == "raise":
        raise ValueError("bad ground truth")
    if ground_truth == "nan":
        return float("nan")
    if ground_truth == "none":
        return None
    if ground_truth == "text":
        return "high"
    return {"score": float(ground_truth), "parsed": True, "acc": float(ground_truth) > 0}

def trl_reward(prompts, completions, **kwargs):
    return [None if c == "skip" else float(len(p) + len(c)) for p, c in zip(prompts, completions)]

async def trl_async_sleepy(prompts, completions, **kwargs):
    import asyncio
    await asyncio.sleep(60 if "sleep" in completions else 0)
    return [1.0] * len(completions)
'''


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad_rewards") / "bad_rewards.py"
    path.write_text(BAD_REWARDS)
    return path


@pytest.fixture(scope="module")
def rule_executor():
    with RewardExecutor(RewardConfig(num_workers=2, timeout_s=5.0)) as ex:
        yield ex


@pytest.fixture(scope="module")
def bad_executor(reward_file):
    cfg = RewardConfig(function=f"{reward_file}:compute_score", num_workers=2, timeout_s=2.0, on_error=-1.0)
    with RewardExecutor(cfg) as ex:
        yield ex


def _item(truth, source="user", uid=None):
    return RewardItem(data_source=source, solution_str="resp", ground_truth=truth, uid=uid)


def test_rule_rewards_metrics_per_data_source(rule_executor):
    items = [
        RewardItem("openai/gsm8k", "#### 1,000", "1000"),  # 1
        RewardItem("openai/gsm8k", "no number here", "3"),  # 0, unparsed
        RewardItem("arith", r"\boxed{12}", "12"),  # 1
        RewardItem("arith", r"\boxed{11}", "12"),  # 0
        RewardItem("countdown", "<answer>(3+5)*2</answer>", '{"target": 16, "numbers": [3, 5, 2]}'),  # 1
    ]
    res = rule_executor.score(items)
    assert res.scores == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert res.failures == [None] * 5
    m = res.metrics
    assert m["reward/openai/gsm8k/mean"] == 0.5  # (1 + 0) / 2
    assert m["reward/arith/mean"] == 0.5  # (1 + 0) / 2
    assert m["reward/countdown/mean"] == 1.0
    assert m["reward/score/mean"] == pytest.approx(0.6)  # 3 / 5
    assert m["reward/unparsed_frac"] == pytest.approx(0.2)  # 1 of 5 had nothing to extract
    assert m["reward/arith/boxed/mean"] == 1.0  # both arith answers were boxed
    assert {m[k] for k in ("reward/errors", "reward/nan", "reward/timeouts", "reward/crashes")} == {0.0}
    assert res.extra["parsed"] == [True, False, True, True, True]
    assert res.extra["pred"][0] == "1,000"


def test_rule_rewards_a_few_hundred_rows_well_under_a_second(rule_executor):
    items = [RewardItem("openai/gsm8k", f"so #### {i}", "7") for i in range(400)]
    rule_executor.score(items[:10])  # warm
    t0 = time.perf_counter()
    res = rule_executor.score(items)
    elapsed = time.perf_counter() - t0
    assert res.scores[7] == 1.0 and sum(res.scores) == 1.0  # only "#### 7" matches
    assert elapsed < 1.0, f"400 gsm8k rows took {elapsed:.2f} s"


def test_unknown_data_source_fails_before_scoring(rule_executor):
    with pytest.raises(UnknownDataSourceError, match=r"'no/such'.*aime\*"):
        rule_executor.score([RewardItem("no/such", "x", "1")])


def test_a_data_source_claimed_by_a_prefix_is_scored_in_the_executor(rule_executor):
    # 'aime_2026' is no registered name; DAPO's scorer claims every 'aime*' name (verl routes them so)
    res = rule_executor.score([RewardItem("aime_2026", "so\nAnswer: 42", "42"), RewardItem("aime_2026", "Answer: 7", "42")])
    assert res.scores == [1.0, -1.0] and res.failures == [None, None]


def test_rule_reward_raising_on_bad_truth_is_an_error_row(rule_executor):
    res = rule_executor.score([RewardItem("arith", "12", "twelve"), RewardItem("arith", "12", "12")])
    assert res.scores == [0.0, 1.0] and res.failures == ["error", None]
    assert "not a number" in res.logs[0] and "row 0" in res.logs[0]


def test_raise_nan_none_and_non_number(bad_executor):
    res = bad_executor.score([_item("1"), _item("raise"), _item("nan"), _item("none"), _item("text"), _item("0")])
    assert res.scores == [1.0, -1.0, -1.0, -1.0, -1.0, 0.0]  # failures get on_error = -1
    assert res.failures == [None, "error", "nan", "nan", "error", None]
    assert res.metrics["reward/errors"] == 2.0 and res.metrics["reward/nan"] == 2.0
    assert len(res.logs) == 4
    assert "row 1" in res.logs[0] and "ValueError: bad ground truth" in res.logs[0]
    # mean over all rows of the data_source, failures at their on_error score: (1 - 1 - 1 - 1 - 1 + 0) / 6
    assert res.metrics["reward/user/mean"] == pytest.approx(-3 / 6)
    assert res.metrics["reward/user/acc/mean"] == 0.5  # only the two ok rows report acc: (1 + 0) / 2


def test_timeout_kills_only_that_row(bad_executor):
    # 6 rows on 2 workers go out one row at a time (small batch): while row 1 hangs, the other
    # worker scores rows 2-5; at the batch's deadline only row 1 is left
    items = [_item("1"), _item("sleep", uid="p-7"), _item("0.5"), _item("2"), _item("3"), _item("4")]
    t0 = time.perf_counter()
    res = bad_executor.score(items)
    elapsed = time.perf_counter() - t0
    assert res.scores == [1.0, -1.0, 0.5, 2.0, 3.0, 4.0]
    assert res.failures == [None, "timeout", None, None, None, None]
    assert res.metrics["reward/timeouts"] == 1.0
    assert res.logs == [
        "reward timeout on row 1 (data_source=user, uid=p-7): still running at the deadline (2 s for the batch); "
        "worker killed; scored -1"
    ]
    assert elapsed < 10, elapsed  # bounded by timeout_s (2 s) + a worker restart, not by the 60 s sleep


def test_a_reward_that_hangs_on_every_row_costs_one_deadline_per_batch(reward_file):
    # one worker, six rows that all hang, 1 s deadline: the rows time out together (about 1 s),
    # not one after another (6 x 1 s)
    cfg = RewardConfig(function=f"{reward_file}:compute_score", num_workers=1, timeout_s=1.0)
    with RewardExecutor(cfg) as ex:
        t0 = time.perf_counter()
        res = ex.score([_item("sleep") for _ in range(6)])
        elapsed = time.perf_counter() - t0
        assert res.failures == ["timeout"] * 6
        assert res.metrics["reward/timeouts"] == 6.0
        assert "still running at the deadline (1 s for the batch); worker killed" in res.logs[0]
        assert all("not started before the deadline (1 s for the batch)" in line for line in res.logs[1:])
        assert elapsed < 3.0, elapsed
        assert ex.score([_item("2")]).scores == [2.0]  # the replaced worker scores the next batch


def test_a_crash_does_not_spend_the_deadline_of_the_rows_after_it(reward_file):
    # one worker, a 0.3 s deadline: the replacement after the crash takes longer than that to
    # start (a fresh interpreter); the clock stops while no worker is up, so rows 1-3 are scored
    cfg = RewardConfig(function=f"{reward_file}:compute_score", num_workers=1, timeout_s=0.3)
    with RewardExecutor(cfg) as ex:
        res = ex.score([_item("exit"), _item("1"), _item("2"), _item("3")])
    assert res.failures == ["crash", None, None, None]
    assert res.scores == [0.0, 1.0, 2.0, 3.0]


def test_rows_queued_behind_a_hung_row_time_out_with_it(bad_executor):
    # 40 rows on 2 workers go out in chunks of 5 (40 // (4 x 2)); row 2 hangs in chunk [0..4]:
    # rows 3 and 4 wait behind it and time out with it, the other worker scores the other 35
    items = [_item("sleep") if i == 2 else _item(str(i)) for i in range(40)]
    res = bad_executor.score(items)
    assert [i for i, f in enumerate(res.failures) if f] == [2, 3, 4]
    assert set(res.failures) == {None, "timeout"}
    assert "still running at the deadline" in res.logs[0] and "row 2" in res.logs[0]
    assert "queued behind a hung row" in res.logs[1] and "row 3" in res.logs[1]
    assert [res.scores[i] for i in (0, 1, 5, 39)] == [0.0, 1.0, 5.0, 39.0]


def test_crash_requeues_the_rest_of_its_chunk(bad_executor):
    restarts = bad_executor.worker_restarts
    items = [_item("exit") if i == 2 else _item(str(i)) for i in range(40)]  # chunks of 5: [0..4] crashes at 2
    res = bad_executor.score(items)
    assert [i for i, f in enumerate(res.failures) if f] == [2]
    assert res.failures[2] == "crash"
    assert res.scores[3:5] == [3.0, 4.0]  # after the crash in its chunk: rescored by a live worker
    assert bad_executor.worker_restarts == restarts + 1


@pytest.mark.parametrize("how", ["exit", "segv"])
def test_crashing_reward_does_not_take_the_caller_down(bad_executor, how):
    restarts = bad_executor.worker_restarts
    items = [_item("1"), _item(how), _item("3"), _item("4"), _item("5"), _item("6")]  # one row per chunk
    res = bad_executor.score(items)
    assert res.scores == [1.0, -1.0, 3.0, 4.0, 5.0, 6.0]  # the rows after the crash are scored
    assert res.failures == [None, "crash", None, None, None, None]
    assert res.metrics["reward/crashes"] == 1.0
    assert "exit code" in res.logs[0] and "row 1" in res.logs[0]
    assert bad_executor.worker_restarts == restarts + 1
    assert bad_executor.score([_item("5")]).scores == [5.0]  # the pool is whole again


def test_every_row_failing_logs_each_row_once(bad_executor):
    res = bad_executor.score([_item("raise") for _ in range(5)])
    assert [line.split(" (")[0] for line in res.logs] == [f"reward error on row {i}" for i in range(5)]


def test_trl_batched_function(reward_file):
    cfg = RewardConfig(function=f"{reward_file}:trl_reward", num_workers=2, on_error=0.0)
    items = [RewardItem("s", c, "", prompt=p) for p, c in [("ab", "cde"), ("a", "skip"), ("", "x"), ("abc", "")]]
    with RewardExecutor(cfg) as ex:
        res = ex.score(items)
    assert res.scores == [5.0, 0.0, 1.0, 3.0]  # len(prompt) + len(completion): 2+3, None→0, 0+1, 3+0
    assert res.failures == [None, "nan", None, None]


def test_async_batched_timeout_fails_its_call(reward_file):
    cfg = RewardConfig(function=f"{reward_file}:trl_async_sleepy", num_workers=1, timeout_s=2.0)
    with RewardExecutor(cfg) as ex:
        res = ex.score([RewardItem("s", "sleep", ""), RewardItem("s", "ok", "")])
        assert res.failures == ["timeout", "timeout"]  # one batched call covers both rows
        assert ex.score([RewardItem("s", "ok", "")]).scores == [1.0]


def test_function_that_does_not_import_is_a_clear_error(tmp_path):
    cfg = RewardConfig(function=f"{tmp_path}/missing.py:fn", num_workers=1)
    with pytest.raises(RewardLoadError, match="missing.py:fn.*does not exist"):
        RewardExecutor(cfg).start()


def test_module_that_kills_its_process_at_import(tmp_path):
    path = tmp_path / "exits.py"
    path.write_text(textwrap.dedent("""
        import os
        os._exit(7)
    """))
    with pytest.raises(RewardLoadError, match="exit code 7"):
        RewardExecutor(RewardConfig(function=f"{path}:fn", num_workers=1)).start()


def test_hung_worker_exits_when_its_trainer_is_killed(tmp_path):
    # workers run in their own session (Ctrl-C is the trainer's); if the trainer is SIGKILLed
    # while a reward hangs, the worker must not live on
    (tmp_path / "hang.py").write_text("def f(data_source, solution_str, ground_truth, extra_info=None):\n"
                                      "    while True:\n        pass\n")  # fmt: skip
    trainer = textwrap.dedent(f"""
        from hybridflow.config import RewardConfig
        from hybridflow.rewards import RewardExecutor, RewardItem
        ex = RewardExecutor(RewardConfig(function="{tmp_path}/hang.py:f", num_workers=1, timeout_s=100))
        ex.start()
        print(ex._pool._workers[0].proc.pid, flush=True)
        ex.score([RewardItem("s", "x", "1")])
    """)
    proc = subprocess.Popen([sys.executable, "-c", trainer], stdout=subprocess.PIPE, text=True)
    worker_pid = int(proc.stdout.readline())
    time.sleep(0.5)
    proc.kill()
    proc.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(worker_pid):
        time.sleep(0.2)
    assert not _alive(worker_pid)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
