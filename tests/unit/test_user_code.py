"""The one import helper behind reward.function and the agents' tool / environment specs."""

import pytest

from hybridflow.agents.loading import AgentLoadError, load_object
from hybridflow.rewards.loader import RewardLoadError, load_reward_function
from hybridflow.user_code import import_user_module


def test_file_import_is_once_per_path_and_prefix(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("X = object()\n")
    a = import_user_module(str(f), label="k", prefix="hybridflow_test_user_", error_cls=ValueError)
    b = import_user_module(str(f), label="k", prefix="hybridflow_test_user_", error_cls=ValueError)
    assert a is b and a.__name__.startswith("hybridflow_test_user_")


def test_each_caller_keeps_its_error_class_message_and_cause(tmp_path):
    f = tmp_path / "broken.py"
    f.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(RewardLoadError, match=r"^reward.function '.*broken.py:f': importing .* failed: RuntimeError: boom") as r:
        load_reward_function(f"{f}:f")
    assert isinstance(r.value.__cause__, RuntimeError)  # reward errors chain the original
    with pytest.raises(AgentLoadError, match=r"^rollout.tools\[0\]='.*broken.py:T': importing .* failed: RuntimeError") as a:
        load_object(f"{f}:T", "rollout.tools[0]")
    assert a.value.__cause__ is None  # agent errors stay one line
    with pytest.raises(AgentLoadError, match="no_such_module_xyz failed: ModuleNotFoundError"):
        load_object("no_such_module_xyz:T", "rollout.environment")
    with pytest.raises(RewardLoadError, match="does not exist"):
        load_reward_function(f"{tmp_path}/missing.py:f")
