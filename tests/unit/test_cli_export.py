"""`hybridflow export`: a checkpoint's policy as a plain HF folder; errors name what exists."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flows.cli import main


def _fake_run(root: Path, steps: tuple[int, ...]) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    """A run dir with tiny-model checkpoints at ``steps`` (weights differ per step: seed = step)."""
    from hybridflow.config import dump_config, load_config
    from hybridflow.models import save_hf_checkpoint
    from hybridflow.models.tiny import build_tiny_model, build_tiny_tokenizer
    from workers.checkpoint import begin_save, commit_save

    run = root / "run-a"
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(load_config(None, ["model.path=tiny"])))
    tok = build_tiny_tokenizer()
    weights = {}
    for step in steps:
        model = build_tiny_model(len(tok), seed=step)
        tmp = begin_save(run / "checkpoints", step)
        save_hf_checkpoint(model, tok, Path(tmp) / "policy")
        commit_save(run / "checkpoints", step, {"iteration": step, "policy_version": step})
        weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return run, weights


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    return _fake_run(tmp_path_factory.mktemp("runs"), (1, 3))


def test_export_step_loads_with_transformers_and_equals_the_checkpoint(fake_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridflow.models.tiny import build_tiny_tokenizer

    run, weights = fake_run
    out = tmp_path / "exported"
    assert main(["export", str(run), "--step", "1", str(out)]) == 0
    assert "exported step 1 of run-a (weights_version 1)" in capsys.readouterr().out
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (out / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(out)
    got = model.state_dict()
    for k, v in weights[1].items():
        assert torch.equal(got[k], v), k
    assert not torch.equal(weights[1]["model.embed_tokens.weight"], weights[3]["model.embed_tokens.weight"])
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("7 + 5")["input_ids"] == build_tiny_tokenizer()("7 + 5")["input_ids"]
    info = json.loads((out / "hybridflow_export.json").read_text())
    assert (info["run_id"], info["step"], info["weights_version"]) == ("run-a", 1, 1)


def test_export_latest_is_the_newest_step(fake_run, tmp_path):
    run, _ = fake_run
    out = tmp_path / "latest"
    assert main(["export", str(run), str(out), "--no-load-check"]) == 0
    assert json.loads((out / "hybridflow_export.json").read_text())["step"] == 3


def test_export_missing_step_lists_the_steps_that_exist(fake_run, tmp_path, capsys):
    run, _ = fake_run
    assert main(["export", str(run), "--step", "2", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint at step 2" in err and "steps saved: 1, 3" in err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("step", ["two", "-1", "step_x"])
def test_export_bad_step_is_an_argument_error(fake_run, tmp_path, capsys, step):
    run, _ = fake_run
    assert main(["export", str(run), "--step", step, str(tmp_path / "x")]) == 2
    assert "expected a number, iter_<N>, step_<N> or 'latest'" in capsys.readouterr().err


def test_export_not_a_run_dir(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["export", str(tmp_path / "nope"), str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "empty"), str(tmp_path / "x")]) == 2
    assert "is not a run directory" in capsys.readouterr().err


def test_export_run_without_checkpoints(tmp_path, capsys):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "config.yaml").write_text("{}\n")
    assert main(["export", str(tmp_path / "r"), str(tmp_path / "x")]) == 2
    assert "has no checkpoint" in capsys.readouterr().err


def test_export_refuses_to_overwrite_without_force(fake_run, tmp_path, capsys):
    run, _ = fake_run
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", str(run), "--step", "1", str(out), "--no-load-check"]) == 2
    assert "--force" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
    assert main(["export", str(run), "--step", "1", str(out), "--no-load-check", "--force"]) == 0
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
