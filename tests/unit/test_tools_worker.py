"""The ``tools`` role (workers/tools.py) without Ray: ToolsWorker ranks behind the ``keyed_scatter``
dispatch protocol drive the multi-turn loop exactly as the in-process EnvRunner does, failing tools
included; the config rules of a tools pool; the loop's choice of runner."""

from __future__ import annotations

import pytest

from hybridflow.agents.remote import EnvCall
from hybridflow.config import config_from_dict
from tests.unit.test_rollout_multi_turn import FIX, TOK, TOOLS, ScriptedEngine, call, rollout
from workers.dispatch import get_dispatch
from workers.handles import role_class
from workers.tools import PoolEnvRunner, ToolsWorker, tools_pool_name

POOLS = {"main": {"workers": 1, "roles": ["policy"]}, "reward": {"workers": 1, "roles": ["reward"]}}


def tools_cfg(**rollout):
    return config_from_dict({
        "rollout": {"tools": [f"{FIX}:add", f"{FIX}:boom", f"{FIX}:hang", f"{FIX}:die"], **rollout},
        "placement": {"pools": {**POOLS, "tools": {"workers": 2, "cpus_per_worker": 0.5, "roles": ["tools"]}}},
    })  # fmt: skip


class LocalToolsPool:
    """The tools pool's ranks in this process: what a RoleHandle does over Ray (split by the method's
    declared protocol, one call per rank that gets a part, join), with a log of each rank's part."""

    def __init__(self, ranks: list[ToolsWorker]) -> None:
        self.ranks, self.parts = ranks, []

    def run(self, requests):
        proto = get_dispatch("keyed_scatter")
        calls, info = proto.split((requests,), {}, len(self.ranks))
        results = []
        for rank, c in zip(self.ranks, calls, strict=True):
            if c is not None:
                self.parts.append(len(c[0][0]))
                results.append(rank.run_env_calls(*c[0], **c[1]))
        return proto.join(results, info)


@pytest.fixture(scope="module")
def tools_pool():
    cfg = tools_cfg(multi_turn={"tool_timeout_s": 3.0, "num_workers": 1})
    ranks = [ToolsWorker(cfg, rank=r, world_size=2) for r in range(2)]
    yield LocalToolsPool(ranks)
    for r in ranks:
        r.close()


def test_list_scatter_cuts_contiguous_parts_and_joins_in_order():
    proto = get_dispatch("list_scatter")
    calls, info = proto.split((list("abcde"), "x"), {"k": 1}, 3)
    assert [c[0][0] for c in calls] == [["a", "b"], ["c", "d"], ["e"]]  # 5 = 2 + 2 + 1
    assert all(c[0][1] == "x" and c[1] == {"k": 1} for c in calls)
    assert proto.join([[1, 2], [3, 4], [5]], info) == [1, 2, 3, 4, 5]
    calls, _ = proto.split((["a"],), {}, 3)
    assert calls[1:] == [None, None]  # ranks with nothing to do are not called
    with pytest.raises(TypeError, match="needs a list"):
        proto.split(("abc",), {}, 2)


def test_keyed_scatter_sends_a_key_to_one_rank_and_the_rest_to_the_least_loaded():
    proto = get_dispatch("keyed_scatter")
    items = [EnvCall.step("e", b"", "a", key=7), EnvCall.step("e", b"s", "b"), EnvCall.step("e", b"", "c", key=9),
             EnvCall.step("e", b"s", "d"), EnvCall.step("e", b"", "e", key=4)]
    calls, info = proto.split((items, "x"), {}, 3)
    # in order: a (key 7) → rank 1; b (no key) → the least loaded, rank 0 (loads 0, 1, 0: the first);
    # c (key 9) → rank 0; d → rank 2 (loads 2, 1, 0); e (key 4) → rank 1
    assert [[c.text for c in part[0][0]] for part in calls] == [["b", "c"], ["a", "e"], ["d"]]
    assert all(part[0][1] == "x" for part in calls)
    assert proto.join([["B", "C"], ["A", "E"], ["D"]], info) == ["A", "B", "C", "D", "E"]
    calls, info = proto.split(([EnvCall.step("e", b"", "a", key=5)],), {}, 3)
    assert calls[0] is None and calls[1] is None and calls[2] is not None  # only rank 5 % 3 is called
    assert proto.join([["A"]], info) == ["A"]  # the results of the called ranks only


def test_tools_worker_is_the_tools_role_and_declares_keyed_scatter():
    assert role_class("tools") is ToolsWorker
    assert ToolsWorker.run_env_calls.__hybridflow_dispatch__ == "keyed_scatter"


def test_tools_pool_ranks_run_the_loop_like_the_in_process_runner(tools_pool):
    """Same script, same observations, masks and ids as tests/unit/test_rollout_multi_turn.py's
    in-process runner; a tool that raises, hangs past tool_timeout_s (3 s) or os._exit-s its process
    is an error observation and the rollout goes on."""
    script = {"QA": [call("add", a=2, b=3), "5"], "QR": [call("boom", x=1), "a"], "QH": [call("hang", x=1), "b"],
              "QX": [call("die", x=1), "c"]}  # fmt: skip
    out = rollout(tools_pool, ScriptedEngine(script), TOOLS, ["QA", "QR", "QH", "QX"])
    assert tools_pool.parts[:2] == [2, 2]  # the 4 resets: 2 per rank
    obs = [m[-2]["content"] for m in out.non_tensors["messages"]]
    assert obs[0] == "5" and "boom raised RuntimeError: boom" in obs[1]
    assert obs[2].startswith("error: the tool call failed (still running") and "3 s" in obs[2]
    assert obs[3].startswith("error: the tool call failed (worker process died")
    assert out.finish_reason == ["stop"] * 4 and out.non_tensors["num_turns"] == [2] * 4
    assert out.metrics["tool/errors"] == 2 and out.metrics["tool/timeouts"] == 1
    # the same rows through one in-process runner give the same tokens and masks (the hang's budget
    # is the same 3 s)
    from hybridflow.agents.remote import EnvRunner

    local = EnvRunner(num_workers=2, timeout_s=3.0)
    try:
        ref = rollout(local, ScriptedEngine(script), TOOLS, ["QA", "QR", "QH", "QX"])
    finally:
        local.close()
    assert out.response_ids.tolist() == ref.response_ids.tolist()
    assert out.response_mask.tolist() == ref.response_mask.tolist()
    after = rollout(tools_pool, ScriptedEngine({"Q": [call("add", a=1, b=2), "3"]}), TOOLS, ["Q"])
    assert after.non_tensors["messages"][0][-2]["content"] == "3"  # the ranks replaced their dead workers


def test_loop_sends_tool_work_to_the_tools_pool_when_one_is_configured():
    from workers.rollout.multi_turn import MultiTurnRollout

    cfg = tools_cfg()
    assert tools_pool_name(cfg) == "tools"
    loop = MultiTurnRollout.from_config(ScriptedEngine({}), TOK, cfg)
    assert isinstance(loop.runner, PoolEnvRunner) and loop.runner.pool_name == "tools"
    assert loop.runner.run([]) == []  # nothing to send: no Ray call
    plain = config_from_dict({"rollout": {"tools": ["calculator"]}})
    assert tools_pool_name(plain) is None


@pytest.mark.parametrize(("change", "needle"), [
    ({"rollout": {}}, "placement.pools.tools: role 'tools' but neither rollout.tools nor rollout.environment"),
    ({"rollout": {"tools": ["calculator"]}, "roles": ["tools", "reward"], "drop_reward": True},
     "placement.pools.tools: role 'tools' shares a pool with reward"),
])  # fmt: skip
def test_tools_pool_config_errors_are_one_line(change, needle):
    pools = {**POOLS, "tools": {"workers": 1, "roles": change.get("roles", ["tools"])}}
    if change.get("drop_reward"):
        pools.pop("reward")
    with pytest.raises(ValueError) as e:
        config_from_dict({"rollout": change["rollout"], "placement": {"pools": pools}})
    line = next(ln for ln in str(e.value).splitlines() if "placement.pools" in ln)
    assert needle in line


def test_a_tools_rank_is_ready_at_once_without_a_process_group():
    """Ranks of a multi-rank tools pool build their ToolsWorker in __init__ (no torch.distributed
    group to join), so a rank Ray restarts serves again by itself."""
    from workers.host import WorkerHost

    cfg = tools_cfg(multi_turn={"num_workers": 1})
    host = WorkerHost(cfg.model_dump(mode="json"), "tools", 1, 2, None)
    try:
        assert host.is_ready() and host.ping()["roles"] == ["tools"]
        reset = EnvCall.reset("tools", {"tools": [f"{FIX}:add"], "tool_format": "hermes"},
                              {"prompt": [{"role": "user", "content": "Q"}]})  # fmt: skip
        [outcome] = host.call("tools", "run_env_calls", [reset])
        assert outcome.ok and outcome.result.messages is None
    finally:
        host.shutdown()


def test_the_host_hands_its_namespace_to_the_rollout_side_and_sets_no_module_state():
    """The run's Ray namespace reaches the tools-pool look-up as constructor arguments (WorkerHost ->
    PolicyWorker -> MultiTurnRollout -> PoolEnvRunner); workers.tools keeps no namespace, and the host
    module does not import workers.tools (the loop pool -> host -> tools -> pool is gone)."""
    import ast
    from pathlib import Path

    import workers.host
    import workers.tools
    from tests.unit._worker_helpers import tiny_cfg
    from workers.host import WorkerHost

    cfg = tiny_cfg("rollout.tools=[calculator]", "placement.pools.main.roles=[policy]",
                   "placement.pools.tools={workers: 1, cpus_per_worker: 0.5, roles: [tools]}")  # fmt: skip
    host = WorkerHost(cfg.model_dump(mode="json"), "main", 0, 1, None, namespace="hybridflow-ns-test")
    try:
        runner = host.workers["policy"]._multi_turn.runner
        assert isinstance(runner, PoolEnvRunner) and (runner.pool_name, runner.namespace) == ("tools", "hybridflow-ns-test")
    finally:
        host.shutdown()
    assert not [k for k in vars(workers.tools) if "namespace" in k]
    tree = ast.parse(Path(workers.host.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "workers.tools" not in imported
