"""workers/runtime.py: a local Ray whose raylet registers after Ray's fixed 30 s wait (a loaded
machine) is started again instead of failing the run; other errors are raised at once."""

from __future__ import annotations

import pytest
import ray

from workers import runtime


def _fake_init(failures: list[str]):
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        if failures:
            raise Exception(failures.pop(0))

    return init, calls


def test_a_startup_timeout_is_tried_again(monkeypatch):
    init, calls = _fake_init(["The current node timed out during startup. This could happen ..."])
    shutdowns = []
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: shutdowns.append(1))
    runtime.init_local_ray(num_cpus=2)
    assert calls == [{"num_cpus": 2}] * 2 and shutdowns == [1]


def test_other_errors_and_the_last_timeout_are_raised(monkeypatch):
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    init, calls = _fake_init(["port 6379 is in use"])
    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(Exception, match="port 6379"):
        runtime.init_local_ray(num_cpus=2)
    assert len(calls) == 1
    init, calls = _fake_init(["The current node timed out during startup."] * 3)
    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(Exception, match="timed out during startup"):
        runtime.init_local_ray(num_cpus=2)
    assert len(calls) == 3
