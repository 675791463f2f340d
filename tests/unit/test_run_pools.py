"""flows/run_pools.py: the pools' lifetime as a context manager, with a fake create/destroy
(no Ray): reward preflight, then Ray, then the pools; destroyed on exit and on error, kept
with placement.keep_pools; nothing to destroy when the start fails."""

from __future__ import annotations

import pytest

import flows.preflight
import flows.runtime
import workers.pool
from flows.preflight import PreflightError
from flows.run_pools import run_pools
from hybridflow.config import load_config


@pytest.fixture
def calls(monkeypatch):
    log: list[tuple] = []

    def create_pools(cfg, *, namespace, ckpt_root):
        log.append(("create", namespace, ckpt_root))
        return {name: f"pool:{name}" for name in cfg.placement.pools}

    monkeypatch.setattr(flows.preflight, "check_reward_function", lambda cfg: log.append(("reward",)))
    monkeypatch.setattr(flows.runtime, "ensure_ray", lambda cfg: log.append(("ray",)))
    monkeypatch.setattr(workers.pool, "create_pools", create_pools)
    monkeypatch.setattr(workers.pool, "destroy_pool", lambda pool: log.append(("destroy", pool)))
    return log


def _cfg(*overrides: str):
    return load_config(None, list(overrides))


def test_pools_come_up_in_order_and_go_at_exit(calls):
    cfg = _cfg()
    names = list(cfg.placement.pools)
    with run_pools(cfg, "hybridflow-r1", "/runs/r1/checkpoints") as pools:
        assert pools == {n: f"pool:{n}" for n in names}
        assert calls == [("reward",), ("ray",), ("create", "hybridflow-r1", "/runs/r1/checkpoints")]
    assert calls[3:] == [("destroy", f"pool:{n}") for n in names]


def test_pools_go_when_the_body_fails(calls):
    cfg = _cfg()
    with pytest.raises(KeyboardInterrupt):
        with run_pools(cfg, "ns", "ckpt"):
            raise KeyboardInterrupt
    assert [c for c in calls if c[0] == "destroy"] == [("destroy", f"pool:{n}") for n in cfg.placement.pools]


def test_keep_pools_keeps_them(calls):
    with run_pools(_cfg("placement.keep_pools=true"), "ns", "ckpt") as pools:
        assert pools
    assert [c[0] for c in calls] == ["reward", "ray", "create"]


def test_a_bad_reward_function_stops_before_ray(calls, monkeypatch):
    def refuse(cfg):
        raise PreflightError("reward.function='nope:fn': module 'nope' not found")

    monkeypatch.setattr(flows.preflight, "check_reward_function", refuse)
    with pytest.raises(PreflightError, match="reward.function="):
        with run_pools(_cfg(), "ns", "ckpt"):
            pytest.fail("the body must not run")
    assert calls == []


def test_a_failed_start_destroys_nothing(calls, monkeypatch):
    def fail(cfg, *, namespace, ckpt_root):
        raise workers.pool.PoolError("pool 'main' cannot be placed")

    monkeypatch.setattr(workers.pool, "create_pools", fail)
    with pytest.raises(workers.pool.PoolError, match="cannot be placed"):
        with run_pools(_cfg(), "ns", "ckpt"):
            pytest.fail("the body must not run")
    assert calls == [("reward",), ("ray",)]
