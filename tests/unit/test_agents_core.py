"""hybridflow.agents: tool schemas, the built-in tools, call formats, environments, config errors."""

import pytest

from hybridflow.agents import AgentLoadError, StepResult, ToolCall, ToolParseError, get_tool_format, load_tool
from hybridflow.agents.checks import check_user_code
from hybridflow.agents.environments import ToolEnvironment, load_environment, normalise_step
from hybridflow.agents.render import truncate_middle
from hybridflow.config import ConfigError, config_from_dict


def test_tool_schema_from_type_hints_and_docstring():
    tool = load_tool("tests.unit.agent_fixtures:add")
    assert tool.name == "add"
    fn = tool.schema["function"]
    assert fn["description"] == "Add two integers."
    assert fn["parameters"]["properties"] == {"a": {"type": "integer", "description": "The first."},
                                              "b": {"type": "integer", "description": "The second."}}
    assert fn["parameters"]["required"] == ["a", "b"]


def test_tool_from_a_file(tmp_path):
    f = tmp_path / "mytools.py"
    f.write_text('def shout(text: str) -> str:\n    """Upper-case.\n\n    Args:\n        text: What.\n    """\n'
                 '    return text.upper()\n')
    tool = load_tool(f"{f}:shout")
    assert tool.fn("hi") == "HI" and tool.schema["function"]["name"] == "shout"


@pytest.mark.parametrize(("spec", "needle"), [
    ("nope", "unknown tool"),
    ("tests.unit.agent_fixtures:no_doc", "needs type hints and a docstring"),
    ("tests.unit.agent_fixtures:missing", "has no attribute 'missing'"),
    ("no_such_module_xyz:f", "importing no_such_module_xyz failed"),
])
def test_bad_tools_fail_with_one_line(spec, needle):
    with pytest.raises(AgentLoadError) as e:
        load_tool(spec)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_builtin_calculator():
    calc = load_tool("calculator").fn
    assert calc("123 * 45") == "5535" and calc("7 / 2") == "3.5" and calc("-(2 + 3) ** 2") == "-25"
    with pytest.raises(ValueError):
        calc("__import__('os').system('true')")


def test_builtin_python_tool_runs_in_the_sandbox():
    out = load_tool("python").fn("print(123 * 45)")
    assert out.strip() == "5535"


def test_hermes_format():
    fmt = get_tool_format("hermes")
    text = 'I will add. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    assert fmt.parse(text) == [ToolCall("add", {"a": 1, "b": 2})]
    assert fmt.parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>') == [ToolCall("f", {"x": 1})]
    assert fmt.parse("The answer is 3.") == []
    for bad in ["<tool_call>{not json}</tool_call>", "<tool_call>{\"name\": 1}</tool_call>", "<tool_call>{\"name\": \"f\""]:
        with pytest.raises(ToolParseError):
            fmt.parse(bad)


def test_python_block_format():
    fmt = get_tool_format("python")
    assert fmt.parse("Let me compute.\n```python\nprint(2)\n```\n") == [ToolCall("python", {"code": "print(2)\n"})]
    with pytest.raises(ToolParseError):
        fmt.parse("```python\nprint(2)\n")


def test_tool_environment_steps():
    env = ToolEnvironment(["tests.unit.agent_fixtures:add", "tests.unit.agent_fixtures:boom"])
    res = env.step('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
    assert res.observation == [{"role": "tool", "name": "add", "content": "5"}] and not res.done
    assert res.info == {"tool_calls": {"add": 1}, "tool_errors": 0, "tool_timeouts": 0}
    res = env.step('<tool_call>{"name": "boom", "arguments": {"x": 1}}</tool_call>')
    assert "boom raised RuntimeError: boom" in res.observation[0]["content"] and res.info["tool_errors"] == 1
    res = env.step("<tool_call>{oops</tool_call>")
    assert res.observation[0]["content"].startswith("could not parse the tool call: ") and res.info["parse_errors"] == 1
    assert env.step("final answer 5").done


def test_step_results_are_normalised():
    assert normalise_step(("obs", 1, 0)) == StepResult("obs", 1.0, False, {})
    assert normalise_step(StepResult(None, None, True)).done
    with pytest.raises(TypeError):
        normalise_step("just text")


def test_environment_loading():
    assert load_environment("tools") is ToolEnvironment
    assert load_environment("tests.unit.agent_fixtures:GuessEnv").__name__ == "GuessEnv"
    with pytest.raises(AgentLoadError, match="unknown environment"):
        load_environment("no-such-env")


def test_truncate_middle():
    assert truncate_middle(list(range(5)), 10, [-1]) == [0, 1, 2, 3, 4]
    assert truncate_middle(list(range(20)), 7, [-1, -1]) == [0, 1, -1, -1, 17, 18, 19]


def _cfg(**rollout):
    return {"rollout": rollout}


@pytest.mark.parametrize(("rollout", "needle"), [
    ({"tools": ["nope"]}, "rollout.tools[0]='nope': unknown tool"),
    ({"tools": ["tests.unit.agent_fixtures:no_doc"]}, "needs type hints and a docstring"),
    ({"environment": "no-such-env"}, "rollout.environment='no-such-env': unknown environment"),
    ({"tools": ["calculator"], "multi_turn": {"max_turns": 0}}, "rollout.multi_turn.max_turns=0"),
    ({"tools": ["calculator"], "max_response_tokens": 32, "multi_turn": {"max_tokens_per_turn": 64}},
     "rollout.multi_turn.max_tokens_per_turn=64 is larger than rollout.max_response_tokens=32"),
    ({"tools": ["calculator"], "multi_turn": {"tool_format": "python"}}, "add 'python' to rollout.tools"),
])
def test_config_errors_are_one_line_naming_the_key(rollout, needle):
    with pytest.raises(ConfigError) as e:  # validation, then the user-code check (imports tools / environment)
        check_user_code(config_from_dict(_cfg(**rollout)))
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_valid_multi_turn_configs():
    cfg = config_from_dict(_cfg(tools=["calculator", "python"], multi_turn={"tool_format": "python"}))
    check_user_code(cfg)
    assert cfg.rollout.is_multi_turn and cfg.rollout.multi_turn.max_turns == 4
    assert config_from_dict(_cfg(environment="tests.unit.agent_fixtures:GuessEnv")).rollout.is_multi_turn
    assert not config_from_dict({}).rollout.is_multi_turn


def test_validation_imports_no_user_code(tmp_path):
    """A config naming a tool file loads without importing it (a worker or a task re-validating the
    config never runs user code); the user-code check imports it and fails in one line."""
    marker = tmp_path / "imported"
    tool = tmp_path / "slow_tool.py"
    tool.write_text(f"open({str(marker)!r}, 'w').close()\nraise RuntimeError('boom')\n")
    cfg = config_from_dict(_cfg(tools=[f"{tool}:f"]))
    assert cfg.rollout.is_multi_turn and not marker.exists()
    with pytest.raises(ConfigError, match=r"^config error: rollout.tools\[0\]='.*slow_tool.py:f': importing .* "
                                          "failed: RuntimeError") as e:
        check_user_code(cfg)
    assert marker.exists() and "\n" not in str(e.value)
    check_user_code(config_from_dict({}))  # single-turn: nothing to import


def test_marked_conversation_for_sample_tables():
    import torch

    from hybridflow.agents.render import marked_conversation
    from hybridflow.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    ids = tok("ab<|im_end|>\n<|im_start|>tool\n5<|im_end|>\ncd<|im_end|>", add_special_tokens=False)["input_ids"]
    model = [True] * 3 + [False] * (len(ids) - 6) + [True] * 3  # "ab<|im_end|>" | observation | "cd<|im_end|>"
    obs = [not m for m in model]
    text = marked_conversation(tok, torch.tensor(ids), torch.tensor(model), torch.tensor(obs))
    assert text == "ab[observation: tool\n5]cd"
