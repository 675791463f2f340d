"""Issue 18, the parts that need no server: every documented command parses, the console's plain
mode, artifact keys and the summary markdown, the automations file, the verbosity switch."""

from __future__ import annotations

import io
import re
import shlex
from pathlib import Path

import pytest

from flows.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def _documented_commands() -> list[str]:
    """`hybridflow ...` lines of the README's quick reference and of docs/cli.md's and docs/async.md's code blocks,
    continuation lines joined and comments dropped; synopsis lines (``[...]``, ``|``, ``...``) left out."""
    texts = [ROOT / "README.md", ROOT / "docs" / "cli.md", ROOT / "docs" / "async.md"]
    out = []
    for path in texts:
        for block in _code_blocks(path.read_text()):
            joined = re.sub(r"\\\n\s*", " ", block)
            for line in joined.splitlines():
                line = line.split("  #")[0].strip()
                line = line.removeprefix(".venv/bin/")
                if not line.startswith("hybridflow ") or any(s in line for s in ("[", "|", "...")):
                    continue
                out.append(line)
    return out


def _code_blocks(text: str) -> list[str]:
    blocks, current = [], None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append("\n".join(current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def test_the_docs_have_commands_to_check():
    cmds = _documented_commands()
    assert any(c.startswith("hybridflow config show") for c in cmds)
    assert any("--register" in c for c in cmds)
    assert len(cmds) >= 12, cmds


@pytest.mark.parametrize("command", _documented_commands())
def test_every_documented_command_parses(command):
    argv = shlex.split(command.replace("<run_id>", "run-x"))[1:]
    args = build_parser().parse_args(argv)  # SystemExit(2) on e.g. "unrecognized arguments"
    assert args.command == argv[0]


def test_overrides_after_options_are_taken():
    args = build_parser().parse_args(["config", "show", "-c", "examples/grpo_arith.yaml", "actor.lr=3e-6"])
    assert args.overrides == ["actor.lr=3e-6"] and args.config == "examples/grpo_arith.yaml"
    args = build_parser().parse_args(["train", "a.b=1", "-c", "x.yaml", "c.d=2", "--resume", "r"])
    assert args.overrides == ["a.b=1", "c.d=2"] and args.resume == "r"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["config", "show", "-c", "x.yaml", "not-an-override"])


def test_config_show_prints_the_override(capsys):
    from flows.cli import main

    assert main(["config", "show", "-c", "examples/grpo_arith.yaml", "actor.lr=3e-6"]) == 0
    assert "lr: 3.0e-06" in capsys.readouterr().out


def test_verbose_switch_sets_prefects_console_level(monkeypatch):
    from flows import console

    monkeypatch.delenv("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", raising=False)
    console.configure_console_logging(verbose=False)
    assert console.quiet() and console.ray_init_options()["log_to_driver"] is False
    import os

    assert os.environ["PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"] == "WARNING"
    monkeypatch.delenv("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL")
    console.configure_console_logging(verbose=True)
    assert not console.quiet() and console.ray_init_options() == {"log_to_driver": True}
    assert "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL" not in os.environ
    monkeypatch.delenv(console.CONSOLE_ENV)


def test_plain_console_writes_one_line_per_iteration(tmp_path):
    from flows.console import RunConsole

    stream = io.StringIO()
    con = RunConsole("r1", str(tmp_path), 3, stream=stream)
    assert not con.live_mode  # a StringIO is not a terminal
    con.start()
    for it in (1, 2, 3):
        con.iteration_done(it, {"critic/score/mean": 0.25 * it, "timing_s/step": 2.0, "actor/pg_loss": float("nan")})
    con.validation_done(3, {"val-core/arith/acc/mean@1": 0.5, "timing_s/validate": 1.0})
    con.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 + 3 + 1, lines
    assert lines[1].startswith("iteration 1/3  score 0.250  step 2.0s  ETA ")
    assert "pg_loss" not in lines[1]  # NaN left out
    assert lines[3].endswith("ETA 0s")
    assert lines[4] == "validation after iteration 3: arith/acc/mean@1 0.500"


def test_live_console_renders_progress_phase_and_metrics(tmp_path):
    import json

    from rich.console import Console

    from flows.console import RunConsole

    (tmp_path / "execution_log.jsonl").write_text(
        "".join(json.dumps({"iteration": i, "node": n}) + "\n" for i, n in [(1, "rollout"), (2, "rollout"), (2, "reward")]))
    con = RunConsole("r1", str(tmp_path), 4, stream=io.StringIO(), live=True)
    con.iteration_done(1, {"critic/score/mean": 0.5})
    buf = io.StringIO()
    Console(file=buf, width=120).print(con)
    text = buf.getvalue()
    assert "iteration 2/4" in text and "ETA" in text
    assert "in progress: rollout → reward" in text
    assert "score 0.500" in text


def test_artifact_keys_and_summary_markdown():
    from flows.artifacts import artifact_key, headline_metrics, summary_markdown

    assert artifact_key("20250101-120000_GRPO", "iteration") == "20250101-120000-grpo-iteration"
    assert headline_metrics({"critic/score/mean": 1.0, "actor/pg_loss": float("nan"), "other": 2.0}) == {
        "critic/score/mean": 1.0}
    md = summary_markdown({"run_id": "r", "iterations": 2, "reward_first": 0.1, "reward_last": 0.3,
                           "reward_curve": [0.1, 0.3], "val_before": {"val-core/arith/acc/mean@1": 0.25},
                           "val_after": {}, "checkpoint": "/x/step_000002", "mlflow_run_id": "abc",
                           "mlflow_uri": "http://h:5000"}, "http://h:5000/#/experiments/1/runs/abc")
    assert "| reward per iteration | 0.100, 0.300 |" in md
    assert "arith/acc/mean@1 = 0.250" in md
    assert "[abc](http://h:5000/#/experiments/1/runs/abc)" in md


def test_validation_regression_is_flagged_against_the_best_so_far():
    from flows.artifacts import PrefectReporter

    rep = PrefectReporter("r", "", 5, alert_val_drop=0.05)  # no flow run: nothing is sent
    key = "val-core/arith/acc/mean@1"
    assert rep.note_validation({key: 0.40}) is False
    assert rep.note_validation({key: 0.50}) is False
    assert rep.note_validation({key: 0.46}) is False  # 0.04 below the best
    assert rep.note_validation({key: 0.44}) is True  # 0.06 below the best


def test_automations_file_validates_with_prefects_schema(tmp_path):
    from flows.automations import AutomationError, load_automations

    automations = load_automations(ROOT / "deployments" / "automations.yaml")
    by_name = {a.name: a for a in automations}
    nan = by_name["hybridflow-pause-on-nan-stop"]
    assert nan.trigger.expect == {"hybridflow.run.stopped"}
    assert [a.type for a in nan.actions] == ["pause-deployment"]
    assert "hybridflow-pause-on-validation-drop" in by_name
    bad = tmp_path / "a.yaml"
    bad.write_text("automations:\n  - name: x\n    trigger: {type: event, posture: Sideways}\n    actions: []\n")
    with pytest.raises(AutomationError, match="automation 'x'"):
        load_automations(bad)
