"""Bad input is a clear error before anything heavy starts (no Prefect server, no Ray, no pools),
naming what is wrong, where, and the value — or, where the config says so, a counted skip.

Each case runs ``hybridflow train`` (``flows.cli.main``) with the Prefect server and Ray start
replaced by a tripwire: reaching them would fail the test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.cli import main
from hybridflow.data import write_rows
from hybridflow.data.tasks import make_arith


@pytest.fixture
def no_servers(monkeypatch):
    """Starting the Prefect server or Ray is 'heavy work': the checks must fail before it."""
    import flows.runtime

    def tripwire(*a, **k):
        raise AssertionError("a server was started before the input was checked")

    monkeypatch.setattr(flows.runtime, "launch_prefect_api", tripwire)
    monkeypatch.setattr(flows.runtime, "ensure_ray", tripwire)


@pytest.fixture
def good_data(tmp_path):
    path = tmp_path / "train.jsonl"
    write_rows(make_arith(6, difficulty=0, seed=1), str(path))
    return path


def args_for(tmp_path: Path, train: Path | str, **extra: str) -> list[str]:
    base = {
        "model.path": "tiny",
        "data.train_files": f"[{train}]",
        "data.prompts_per_iteration": "2",
        "rollout.samples_per_prompt": "2",
        "actor.mini_batch_trajectories": "4",
        "actor.micro_batch_trajectories": "2",
        "critic.mini_batch_trajectories": "4",
        "critic.micro_batch_trajectories": "2",
        "trainer.run_dir": str(tmp_path / "runs"),
        "trainer.device": "cpu",
    }
    base.update(extra)
    return ["train", *[f"{k}={v}" for k, v in base.items()]]


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


def test_missing_dataset_file(tmp_path, capsys, no_servers):
    missing = tmp_path / "nope" / "train.parquet"
    code, err = run_cli(args_for(tmp_path, missing), capsys)
    assert code == 2
    assert "data.train_files" in err and str(missing) in err and "does not exist" in err


def test_tools_that_do_not_import(tmp_path, capsys, no_servers, good_data):
    """The user-code check left config validation but still fails before any server: rc 2, one line."""
    code, err = run_cli(args_for(tmp_path, good_data, **{"rollout.tools": "[nope]"}), capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "rollout.tools[0]='nope': unknown tool" in err


def test_dataset_that_is_not_parquet_or_jsonl(tmp_path, capsys, no_servers):
    csv = tmp_path / "train.csv"
    csv.write_text("prompt,answer\n1+1,2\n")
    code, err = run_cli(args_for(tmp_path, csv), capsys)
    assert code == 2
    assert "data.train_files" in err and str(csv) in err and "unknown format" in err
    fake = tmp_path / "fake.parquet"  # right name, wrong bytes: pyarrow's own error, attributed to the file
    fake.write_text("this is not parquet\n")
    code, err = run_cli(args_for(tmp_path, fake), capsys)
    assert code == 2
    assert f"data.train_files: cannot read {str(fake)!r}" in err and "Parquet" in err


def _rows_with_a_bad_one(tmp_path: Path) -> Path:
    rows = make_arith(7, difficulty=0, seed=1)
    del rows[3]["prompt"]  # row 3 has no prompt
    path = tmp_path / "train.jsonl"
    write_rows(rows, str(path))
    return path


def test_bad_row_names_file_row_and_field(tmp_path, capsys, no_servers):
    path = _rows_with_a_bad_one(tmp_path)
    code, err = run_cli(args_for(tmp_path, path), capsys)
    assert code == 2
    assert f"{path}: row 3: field 'prompt': missing" in err
    assert "data.on_bad_row=skip" in err  # says how to skip instead


def test_bad_row_skipped_and_counted_when_configured(tmp_path, no_servers):
    from flows.preflight import preflight
    from hybridflow.config import load_config

    path = _rows_with_a_bad_one(tmp_path)
    cfg = load_config(None, args_for(tmp_path, path, **{"data.on_bad_row": "skip"})[1:])
    report = preflight(cfg)
    # 7 rows written, 1 bad → 6 prompts kept, 1 skipped
    assert report["data/train_skipped_rows"] == 1.0
    assert report["data/train_prompts"] == 6.0


def test_prompt_longer_than_the_limit(tmp_path, capsys, no_servers, good_data):
    code, err = run_cli(args_for(tmp_path, good_data, **{"data.max_prompt_tokens": "8"}), capsys)
    assert code == 2
    # names the row, its uid and file, its length and the limit, and the other policies
    assert "prompt of row 0 (uid train-0" in err and str(good_data) in err
    assert "longer than data.max_prompt_tokens=8" in err and "data.overlong_prompt=filter" in err


def test_contradictory_batch_sizes(tmp_path, capsys, no_servers, good_data):
    code, err = run_cli(args_for(tmp_path, good_data, **{"actor.mini_batch_trajectories": "3"}), capsys)
    assert code == 2
    # 2 prompts × 2 samples = 4 trajectories per step, not divisible into mini-batches of 3
    assert "actor.mini_batch_trajectories=3 must divide" in err and "= 4" in err
    code, err = run_cli(args_for(tmp_path, good_data, **{"data.prompts_per_iteration": "8",
                                                         "actor.mini_batch_trajectories": "16",
                                                         "actor.micro_batch_trajectories": "4",
                                                         "critic.mini_batch_trajectories": "16"}), capsys)
    assert code == 2
    assert "data.prompts_per_iteration=8 but data.train_files hold 6 usable prompts" in err


def test_model_path_that_does_not_exist(tmp_path, capsys, no_servers, good_data):
    missing = tmp_path / "no-such-model"
    code, err = run_cli(args_for(tmp_path, good_data, **{"model.path": str(missing)}), capsys)
    assert code == 2
    assert f"model.path={str(missing)!r}" in err and "does not exist" in err


def test_reward_model_path_that_does_not_exist(tmp_path, capsys, no_servers, good_data):
    missing = tmp_path / "no-such-rm"
    code, err = run_cli(args_for(tmp_path, good_data, **{"reward.model.path": str(missing)}), capsys)
    assert code == 2
    assert f"reward.model.path={str(missing)!r}" in err and "does not exist" in err


def test_vllm_engine_without_the_vllm_runtime(tmp_path, capsys, no_servers, good_data, monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_VLLM_PYTHON", str(tmp_path / "no-runtime" / "bin" / "python"))
    code, err = run_cli(args_for(tmp_path, good_data, **{"rollout.engine": "vllm", "trainer.device": "auto"}), capsys)
    assert code == 2
    assert "rollout.engine=vllm needs the vLLM runtime" in err and "make setup-vllm" in err


def test_reward_function_that_does_not_import(tmp_path, capsys, no_servers, good_data):
    bad = tmp_path / "my_reward.py"
    bad.write_text("import no_such_module_hybridflow\n\ndef compute_score(data_source, solution_str, ground_truth):\n"
                   "    return 0.0\n")
    spec = f"{bad}:compute_score"
    code, err = run_cli(args_for(tmp_path, good_data, **{"reward.function": spec}), capsys)
    assert code == 2
    assert f"reward.function {spec!r}" in err and "ModuleNotFoundError" in err and "no_such_module_hybridflow" in err
    missing = f"{tmp_path / 'missing.py'}:compute_score"
    code, err = run_cli(args_for(tmp_path, good_data, **{"reward.function": missing}), capsys)
    assert code == 2
    assert f"reward.function {missing!r}" in err and "does not exist" in err


def test_tokenizer_without_chat_template(tmp_path, capsys, no_servers, good_data):
    from hybridflow.models.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.chat_template = None
    folder = tmp_path / "plain-tokenizer"
    tok.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    code, err = run_cli(args_for(tmp_path, good_data, **{"model.tokenizer_path": str(folder)}), capsys)
    assert code == 2
    assert f"model.tokenizer_path={str(folder)!r}: the tokenizer has no chat template" in err
    assert "data.apply_chat_template=false" in err


def test_unwritable_run_dir(tmp_path, capsys, no_servers, good_data):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    run_dir = blocker / "runs"  # cannot be created under a file (also for root, unlike chmod)
    code, err = run_cli(args_for(tmp_path, good_data, **{"trainer.run_dir": str(run_dir)}), capsys)
    assert code == 2
    assert f"trainer.run_dir={str(run_dir)!r} is not writable" in err


def test_train_flow_checks_inputs_before_pools(tmp_path, good_data):
    """The same checks guard the flow itself (a run started from a deployment, not the CLI)."""
    from flows.preflight import PreflightError
    from flows.run_state import open_run
    from hybridflow.config import load_config

    cfg = load_config(None, args_for(tmp_path, good_data, **{"model.path": str(tmp_path / "gone")})[1:])
    with pytest.raises(PreflightError, match="model.path="):
        open_run(cfg, resume=None)
    cfg = load_config(None, args_for(tmp_path, good_data, **{"trainer.run_dir": str(good_data / "x")})[1:])
    with pytest.raises(PreflightError, match="trainer.run_dir="):
        open_run(cfg, resume=None)


def test_ground_truth_is_required_only_by_rule_rewards(tmp_path):
    from flows.preflight import PreflightError, load_datasets
    from hybridflow.config import load_config

    rows = make_arith(6, difficulty=0, seed=1)
    del rows[2]["reward_model"]["ground_truth"]
    path = tmp_path / "train.jsonl"
    write_rows(rows, str(path))
    with pytest.raises(PreflightError, match=r"row 2: field 'reward_model.ground_truth': missing"):
        load_datasets(load_config(None, args_for(tmp_path, path)[1:]))
    custom = load_config(None, args_for(tmp_path, path, **{"reward.function": "my_rewards:score"})[1:])
    assert load_datasets(custom).report["data/train_prompts"] == 6.0
