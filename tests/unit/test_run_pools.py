"""flows/run_pools.py: the pools' lifetime as a context manager, one for train, evaluate and node
run, with a fake create/destroy (no Ray): reward preflight, then Ray, then the pools of the roles
asked for; destroyed on exit and on error, kept with ``keep`` (train: placement.keep_pools);
a failed start destroys what it created; no roles, no Ray."""

from __future__ import annotations

import pytest

import flows.preflight
import flows.runtime
import workers.pool
from flows.preflight import PreflightError
from flows.run_pools import open_pools, pools_for
from hybridflow.config import load_config


@pytest.fixture
def calls(monkeypatch):
    log: list[tuple] = []

    def create_pool(cfg, name, *, namespace, ckpt_root):
        log.append(("create", name, namespace, ckpt_root))
        return f"pool:{name}"

    monkeypatch.setattr(flows.preflight, "check_reward_function", lambda cfg: log.append(("reward",)))
    monkeypatch.setattr(flows.runtime, "ensure_ray", lambda cfg: log.append(("ray",)))
    monkeypatch.setattr(workers.pool, "create_pool", create_pool)
    monkeypatch.setattr(workers.pool, "destroy_pool", lambda pool: log.append(("destroy", pool)))
    return log


def _cfg(*overrides: str):
    return load_config(None, list(overrides))


SPLIT = ("placement.pools.main.roles=[policy,critic]", "placement.pools.ref.roles=[reference]", "actor.use_kl_loss=true")  # a reference pool of its own


def test_pools_come_up_in_order_and_go_at_exit(calls):
    cfg = _cfg()
    names = list(cfg.placement.pools)
    with open_pools(cfg, namespace="hybridflow-r1", ckpt_root="/runs/r1/checkpoints") as pools:
        assert pools == {n: f"pool:{n}" for n in names}
        assert calls == [("reward",), ("ray",)] + [("create", n, "hybridflow-r1", "/runs/r1/checkpoints") for n in names]
    assert calls[2 + len(names):] == [("destroy", f"pool:{n}") for n in names]


def test_pools_go_when_the_body_fails(calls):
    cfg = _cfg()
    with pytest.raises(KeyboardInterrupt):
        with open_pools(cfg, namespace="ns", ckpt_root="ckpt"):
            raise KeyboardInterrupt
    assert [c for c in calls if c[0] == "destroy"] == [("destroy", f"pool:{n}") for n in cfg.placement.pools]


def test_keep_keeps_them(calls):
    with open_pools(_cfg(), namespace="ns", ckpt_root="ckpt", keep=True) as pools:
        assert pools
    assert "destroy" not in [c[0] for c in calls]


def test_a_bad_reward_function_stops_before_ray(calls, monkeypatch):
    def refuse(cfg):
        raise PreflightError("reward.function='nope:fn': module 'nope' not found")

    monkeypatch.setattr(flows.preflight, "check_reward_function", refuse)
    with pytest.raises(PreflightError, match="reward.function="):
        with open_pools(_cfg(), namespace="ns", ckpt_root="ckpt"):
            pytest.fail("the body must not run")
    assert calls == []


def test_a_failed_start_destroys_what_it_created(calls, monkeypatch):
    cfg = _cfg(*SPLIT)
    first, second = list(cfg.placement.pools)[:2]

    def create_pool(cfg, name, *, namespace, ckpt_root):
        if name == second:
            raise workers.pool.PoolError(f"pool {name!r} cannot be placed")
        return f"pool:{name}"

    monkeypatch.setattr(workers.pool, "create_pool", create_pool)
    with pytest.raises(workers.pool.PoolError, match="cannot be placed"):
        with open_pools(cfg, namespace="ns", ckpt_root="ckpt"):
            pytest.fail("the body must not run")
    assert calls == [("reward",), ("ray",), ("destroy", f"pool:{first}")]


def test_only_the_pools_of_the_roles_come_up(calls):
    cfg = _cfg(*SPLIT)
    assert "ref" in cfg.placement.pools
    with open_pools(cfg, ("policy", "reward"), namespace="ns") as pools:  # evaluate: validate's roles
        assert "ref" not in pools and set(pools) == set(pools_for(cfg, ("policy", "reward")))
    with open_pools(cfg, ("reference",), namespace="ns") as pools:  # no reward pool: no reward preflight
        assert list(pools) == ["ref"]
    assert calls.count(("reward",)) == 1


def test_no_roles_no_ray(calls):
    with open_pools(_cfg(), (), namespace="ns") as pools:  # a node that calls no pool
        assert pools == {}
    assert calls == []
