"""hybridflow/registry.py: one Registry(kind) behind every register_* decorator."""

from __future__ import annotations

import pytest

from hybridflow.registry import DuplicateNameError, Registry, UnknownNameError


def test_register_get_names():
    reg: Registry = Registry("widget")

    @reg.register("b")
    def b():
        return "b"

    assert reg.register("a")(len) is len  # the decorator returns the object unchanged
    assert reg.get("b") is b and reg.names() == ["a", "b"] and list(reg) == ["a", "b"]
    assert "a" in reg and "c" not in reg and len(reg) == 2
    assert reg.owner("b") == __name__ and reg.owner("a") == "builtins"


def test_a_duplicate_names_the_module_that_registered_it_first():
    reg: Registry = Registry("widget")
    reg.register("x")(test_register_get_names)
    with pytest.raises(DuplicateNameError, match=rf"widget 'x' is already registered \(by {__name__}\)") as info:
        reg.add("x", object(), module="someone.else")
    assert isinstance(info.value, ValueError)  # what register_* callers always caught
    assert reg.get("x") is test_register_get_names  # the first registration stays


def test_an_unknown_name_lists_the_options_unquoted():
    reg: Registry = Registry("widget")
    reg.add("b", 1)
    reg.add("a", 2)
    with pytest.raises(UnknownNameError) as info:
        reg.get("c")
    assert str(info.value) == "unknown widget 'c'; known: a, b"  # not KeyError's quoted repr
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
    with pytest.raises(UnknownNameError, match="unknown widget"):
        reg.get(["unhashable"])


def test_builtins_load_once_on_first_lookup():
    calls = []
    reg: Registry = Registry("widget", builtins=lambda: calls.append(reg.add("builtin", 0)))
    reg.register("user")(1)  # registering does not load the built-ins
    assert calls == []
    assert reg.names() == ["builtin", "user"] and reg.get("builtin") == 0
    assert len(calls) == 1


@pytest.mark.parametrize("module, attr, name", [
    ("hybridflow.algorithms.registry", "register_advantage_estimator", "grpo"),
    ("hybridflow.algorithms.registry", "register_policy_loss", "ppo"),
    ("hybridflow.rewards.format", "register_format_style", "boxed"),
    ("hybridflow.agents.formats", "register_tool_format", "hermes"),
    ("workers.rollout.base", "register_rollout_engine", "hf"),
])
def test_every_public_decorator_refuses_a_taken_name_naming_its_owner(module, attr, name):
    import importlib

    register = getattr(importlib.import_module(module), attr)
    if attr == "register_rollout_engine":
        importlib.import_module("workers.rollout").base.get_rollout_engine(name)  # loads the built-ins
    with pytest.raises(DuplicateNameError, match=rf"{name}' is already registered \(by [\w.]+\)"):
        register(name)(lambda *a, **k: None)


def test_reward_and_dispatch_registries_name_the_owner():
    from hybridflow.rewards import get_reward, register_reward
    from workers.dispatch import get_dispatch, register_dispatch

    get_reward("arith")  # loads the built-in rewards
    with pytest.raises(DuplicateNameError, match=r"'arith' is already registered \(by hybridflow\.rewards\.arith\)"):
        register_reward("arith")(lambda *a: {"score": 0.0})
    with pytest.raises(DuplicateNameError, match=r"'dp_scatter' is already registered \(by workers\.dispatch\)"):
        register_dispatch("dp_scatter", lambda *a: None, lambda *a: None)
    with pytest.raises(KeyError, match="unknown dispatch protocol 'nope'; known: .*dp_scatter"):
        get_dispatch("nope")
