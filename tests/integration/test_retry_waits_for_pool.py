"""A retried node waits for the pools (issue 40): a tools-pool actor killed mid-call recovered only on
the last of its Prefect retries, because the first retry came 2.6 s after the kill, before Ray had
the rank back. Now a retry first waits (``placement.retry_wait_s``, 60 s) until every pool's ranks
answer, ready, so one kill spends one retry.

The node here reaches the tools pool the way a rollout does: not through ``pool_of`` (which waits
only for the node's own role), but directly. Its first attempt kills the tools rank (and waits
until the process is gone); its retry, which comes at once (``retry_delay_s=0``), pings the rank
with a 0.5 s deadline: a rank still restarting (a new process importing torch takes seconds) does
not answer in time, so without the wait the retry, and the flow run, fail."""

from __future__ import annotations

import time

import psutil
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _tools_cfg():
    from hybridflow.config import config_from_dict

    return config_from_dict({
        "rollout": {"tools": ["calculator"]},
        "placement": {"pools": {"main": {"workers": 1, "roles": ["policy"]}, "reward": {"workers": 1, "roles": ["reward"]},
                                "tools": {"workers": 1, "cpus_per_worker": 0.5, "roles": ["tools"]}}},
    })  # fmt: skip


def test_the_retry_of_a_node_whose_actor_died_waits_until_the_rank_is_back(prefect_api, ray_cluster, tmp_path):
    import ray
    from prefect import flow

    from tasks.common import RunContext
    from tasks.node import node
    from workers.pool import create_pool, destroy_pool, get_pool

    cfg = _tools_cfg()
    assert cfg.placement.retry_wait_s == 60.0
    namespace = "hybridflow-retry-waits"
    pool = create_pool(cfg, "tools", namespace=namespace, ckpt_root=None)
    first_pid = pool.pids()[0]
    run = RunContext("retry-waits", str(tmp_path), 1, namespace, 0, cfg.model_dump(mode="json"))
    attempts = []

    @node(name="calls_tools", retries=1, retry_delay_s=0, cache=False)
    def calls_tools(run: RunContext) -> dict:
        tools = get_pool("tools", run.namespace, ("tools",))
        attempts.append(time.monotonic())
        if len(attempts) == 1:  # the actor dies mid-call
            ray.kill(tools.actors[0], no_restart=False)
            deadline = time.monotonic() + 30
            while psutil.pid_exists(first_pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            raise RuntimeError("tools rank 0 died mid-call")
        return {"pid": float(tools.ping(deadline_s=0.5)[0]["pid"])}

    @flow(persist_result=False)
    def one_node() -> dict:
        return calls_tools.task(run).metrics

    try:
        metrics = one_node()
        assert len(attempts) == 2, attempts
        assert metrics["pid"] != first_pid  # the restarted rank answered the first retry
    finally:
        destroy_pool(pool, grace_s=5)
