"""The ``python`` tool's walls (issue 40, defect 2): where the machine gives no mount namespace the
tool refuses to start (one line naming what is missing) unless ``rollout.multi_turn.sandbox_walls``
is 'optional': then it runs, warns once and the rollout reports ``sandbox/walls = 0``."""

import logging

import pytest

from hybridflow.agents import tools as tool_mod
from hybridflow.agents.checks import check_user_code
from hybridflow.agents.environments import ToolEnvironment
from hybridflow.config import ConfigError, config_from_dict
from hybridflow.rewards import sandbox
from workers.rollout.multi_turn import multi_turn_metrics

NO_WALLS = sandbox.WallsCheck(False, "a private mount namespace ('unshare -m' fails: Operation not permitted)")


@pytest.fixture
def no_walls(monkeypatch):
    monkeypatch.setattr(sandbox, "walls_check", lambda: NO_WALLS)
    monkeypatch.setattr(tool_mod, "_warned_no_walls", False)


def _python_cfg(walls: str | None = None):
    mt = {} if walls is None else {"sandbox_walls": walls}
    return config_from_dict({"rollout": {"tools": ["python"], "multi_turn": mt}})


def test_the_default_is_required_with_a_64_mb_quota():
    mt = _python_cfg().rollout.multi_turn
    assert mt.sandbox_walls == "required" and mt.sandbox_disk_mb == 64 == sandbox.TMPFS_MB


def test_without_a_mount_namespace_the_run_refuses_in_one_line(no_walls):
    with pytest.raises(ConfigError) as e:
        check_user_code(_python_cfg())
    msg = str(e.value)
    assert "\n" not in msg and "private mount namespace" in msg and "sandbox_walls=optional" in msg, msg
    check_user_code(_python_cfg("optional"))  # the explicit opt-out starts
    check_user_code(config_from_dict({"rollout": {"tools": ["calculator"]}}))  # no python tool: no walls needed


def test_without_a_mount_namespace_the_tool_refuses_to_run(no_walls):
    env = ToolEnvironment(["python"], "hermes", 5.0, sandbox_walls="required")
    res = env.step('<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>')
    content = res.observation[0]["content"]
    assert res.info["tool_errors"] == 1 and "SandboxWallsError" in content and "private mount namespace" in content


def test_optional_walls_run_and_warn_once(no_walls, caplog):
    env = ToolEnvironment(["python"], "hermes", 5.0, sandbox_walls="optional", sandbox_disk_mb=16)
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
    with caplog.at_level(logging.WARNING):
        outs = [env.step(call).observation[0]["content"] for _ in range(2)]
    assert outs == ["42\n", "42\n"]
    assert sum("WITHOUT walls" in r.getMessage() for r in caplog.records) == 1


def test_the_rollout_reports_sandbox_walls(no_walls):
    assert multi_turn_metrics([], ["python"])["sandbox/walls"] == 0.0
    assert "sandbox/walls" not in multi_turn_metrics([], ["calculator"])


def test_the_rollout_reports_walls_where_the_machine_gives_them():
    if not sandbox.walls_check().available:
        pytest.skip(f"no walls on this machine: {sandbox.walls_check().missing}")
    assert multi_turn_metrics([], ["python"])["sandbox/walls"] == 1.0
    check_user_code(_python_cfg())


def test_the_tool_passes_its_disk_quota(monkeypatch):
    seen = {}

    def fake_run_code(code, **kw):
        seen.update(kw)
        return sandbox.SandboxResult(0, "ok\n", "", False, 0.0, True, True, True)

    monkeypatch.setattr(sandbox, "walls_check", lambda: sandbox.WallsCheck(True))
    monkeypatch.setattr(sandbox, "run_code", fake_run_code)
    env = ToolEnvironment(["python"], "hermes", 5.0, sandbox_disk_mb=7)
    assert env.step('<tool_call>{"name": "python", "arguments": {"code": "x"}}</tool_call>').observation[0]["content"] == "ok\n"
    assert seen["disk_mb"] == 7
