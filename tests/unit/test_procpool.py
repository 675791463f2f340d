"""The generic crash-proof process pool (hybridflow/procpool) with a toy call kind
(tests/unit/procpool_toy.py): requests in, the kind's values out; an error, a crash and a timeout
each fail only their own row, are counted, and the pool goes on; a load failure raises the kind's
own exception class."""

from __future__ import annotations

import pytest

from hybridflow.procpool import CallKind, ProcessPool, Unit


class ToyLoadError(RuntimeError):
    pass


TOY = CallKind("toy", "tests.unit.procpool_toy", "the toy", ToyLoadError)


def rows(*requests):
    return [Unit("rows", [(i, r)]) for i, r in enumerate(requests)]


@pytest.fixture(scope="module")
def pool():
    p = ProcessPool(TOY, "toy:", [], num_workers=2)
    p.wait_ready()
    yield p
    p.close()


def test_requests_come_back_as_the_kinds_values_in_order(pool):
    assert isinstance(pool.info, int) and not pool.batched  # what the handler reported when ready
    out = pool.run(rows(("echo", "a"), ("echo", "b"), ("echo", "c")), timeout_s=10.0)
    assert out == {0: ("ok", "toy:a"), 1: ("ok", "toy:b"), 2: ("ok", "toy:c")}


def test_error_crash_and_timeout_fail_their_row_only_and_are_counted(pool):
    before = pool.restarts
    out = pool.run(rows(("raise", "bad"), ("exit", 5), ("echo", "x")), timeout_s=10.0)
    assert out[0][0] == "error" and out[0][1].startswith("raised ValueError: bad at ")
    assert out[1] == ("crash", "worker process died (exit code 5)")
    assert out[2] == ("ok", "toy:x")
    assert pool.restarts == before + 1  # the crashed worker was replaced; the error kept its worker
    out = pool.run(rows(("sleep", 60), ("echo", "y")), timeout_s=1.0)
    assert out[0] == ("timeout", "still running at the deadline (1 s for the batch); worker killed")
    assert out[1] == ("ok", "toy:y")
    assert pool.restarts == before + 2
    assert pool.run(rows(("echo", "z"), ("echo", "w")), timeout_s=10.0) == {0: ("ok", "toy:z"), 1: ("ok", "toy:w")}


def test_an_unpicklable_value_fails_its_row_and_the_worker_lives_on(pool):
    before = pool.restarts
    out = pool.run(rows(("lock",), ("echo", "after")), timeout_s=10.0)
    assert out[0][0] == "error" and "pickle" in out[0][1]
    assert out[1] == ("ok", "toy:after") and pool.restarts == before


def test_a_handler_that_cannot_load_raises_the_kinds_error():
    p = ProcessPool(TOY, "fail", [], num_workers=1)
    try:
        with pytest.raises(ToyLoadError, match=r"^toy worker could not load the toy: RuntimeError: toy setup refused"):
            p.wait_ready()
    finally:
        p.close()


def test_a_worker_killed_while_idle_is_replaced_and_no_row_is_lost():
    """A worker that died between calls (SIGKILL, the OOM killer) is replaced when the next call
    starts, and that call's rows all run: none is failed for a crash it did not cause."""
    import os
    import signal

    p = ProcessPool(TOY, "toy:", [], num_workers=1)
    try:
        p.wait_ready()
        assert p.run(rows(("echo", "a")), timeout_s=10.0) == {0: ("ok", "toy:a")}
        victim = p._workers[0].proc
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(10)
        out = p.run(rows(("echo", "b"), ("echo", "c")), timeout_s=10.0)
        assert out == {0: ("ok", "toy:b"), 1: ("ok", "toy:c")}
        assert p.restarts == 1
    finally:
        p.close()
