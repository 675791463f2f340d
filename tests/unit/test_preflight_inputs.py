"""Every bad input is one line, exit 2, before any server starts (issue 40, defects 5-7): a table
of damaged models, data, sampling values and run folders through ``hybridflow train`` and
``hybridflow eval`` (``flows.cli.main``, in-process, with the Prefect server and Ray start replaced
by a tripwire), plus a read-only and a full run folder for real (a mount namespace, where the
machine gives one)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flows.cli import main
from flows.preflight_inputs import gguf_summary, safetensors_problem
from hybridflow.data import write_rows
from hybridflow.data.tasks import make_arith
from tests.unit.test_cli_export import _fake_run
from tests.unit.test_reliability_inputs import args_for

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_servers(monkeypatch):
    import flows.runtime

    def tripwire(*a, **k):
        raise AssertionError("a server was started before the input was checked")

    monkeypatch.setattr(flows.runtime, "launch_prefect_api", tripwire)
    monkeypatch.setattr(flows.runtime, "ensure_ray", tripwire)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """Every bad input of the table (and the good ones they were made from)."""
    from hybridflow.models import save_hf_checkpoint
    from hybridflow.models.resolve import smollm2_gguf_path
    from hybridflow.models.tiny import build_tiny_model, build_tiny_tokenizer

    root = tmp_path_factory.mktemp("inputs")
    tok = build_tiny_tokenizer()
    good = root / "good_model"
    save_hf_checkpoint(build_tiny_model(len(tok), seed=0), tok, good)
    out = {"good_model": good}
    for name in ("unknown_type", "truncated_safetensors", "no_tokenizer"):
        shutil.copytree(good, root / name)
        out[name] = root / name
    cfg = json.loads((good / "config.json").read_text())
    (out["unknown_type"] / "config.json").write_text(json.dumps({**cfg, "model_type": "nosuchmodel"}))
    weights = out["truncated_safetensors"] / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    for f in out["no_tokenizer"].iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            f.unlink()
    with open(smollm2_gguf_path(), "rb") as src:
        out["truncated_gguf"] = root / "model.gguf"
        out["truncated_gguf"].write_bytes(src.read(8 << 20))  # the whole header, an eighth of the tensors
        out["header_gguf"] = root / "header.gguf"
        src.seek(0)
        out["header_gguf"].write_bytes(src.read(1000))  # cut inside the header
    out["good_data"] = root / "data.jsonl"
    write_rows(make_arith(6, difficulty=0, seed=1), str(out["good_data"]))
    out["latin1_data"] = root / "latin1.jsonl"
    lines = out["good_data"].read_bytes().splitlines(keepends=True)
    out["latin1_data"].write_bytes(b"".join(lines[:3]) + lines[3].replace(b'"', b'"caf\xe9 ', 1) + b"".join(lines[4:]))
    run, _ = _fake_run(root / "runs", (1, 3)) if (root / "runs").mkdir() is None else (None, None)
    out["run"] = run
    for name in ("truncated_ckpt_run", "bad_run_json", "bad_config_yaml"):
        shutil.copytree(run, root / name)
        out[name] = root / name
    policy = out["truncated_ckpt_run"] / "checkpoints" / "iter_000003" / "policy" / "model.safetensors"
    os.truncate(policy, policy.stat().st_size - 100)
    (out["bad_run_json"] / "run.json").write_text('{"run_id": "x", ')
    (out["bad_config_yaml"] / "config.yaml").write_text("model: [unclosed\n  path: tiny\n")
    return out


def _one_line(code: int, err: str, out: str, needle: str) -> None:
    lines = [ln for ln in (err + out).splitlines() if ln.strip()]
    assert code == 2, (code, err, out)
    assert len(lines) == 1 and needle in lines[0], lines


# (case, train overrides, eval argv, what the line names); None: the case does not apply there
CASES = [
    ("unknown model_type", {"model.path": "{unknown_type}"}, ["--model", "{unknown_type}"], "nosuchmodel"),
    ("truncated model.safetensors", {"model.path": "{truncated_safetensors}"},
     ["--model", "{truncated_safetensors}"], "truncated"),
    ("missing tokenizer", {"model.path": "{no_tokenizer}"}, ["--model", "{no_tokenizer}"], "no tokenizer"),
    ("truncated GGUF (data)", {"model.path": "{truncated_gguf}"}, ["--model", "{truncated_gguf}"], "truncated"),
    ("truncated GGUF (header)", {"model.path": "{header_gguf}"}, ["--model", "{header_gguf}"], "truncated"),
    ("non-UTF-8 jsonl", {"data.train_files": "[{latin1_data}]"}, ["--model", "tiny", "--data", "{latin1_data}"],
     "latin1.jsonl:4 is not UTF-8"),
    ("truncated checkpoint", None, ["--model", "{truncated_ckpt_run}"], "damaged"),
    ("truncated checkpoint folder", {"model.path": "{truncated_ckpt_run}/checkpoints/iter_000003/policy"},
     ["--model", "{truncated_ckpt_run}/checkpoints/iter_000003"], "damaged"),
    ("--temperature -1", {"rollout.temperature": "-1"}, ["--model", "tiny", "--temperature", "-1"], "temperature"),
]


def _fill(value: str, inputs: dict[str, Path]) -> str:
    return value.format(**{k: str(v) for k, v in inputs.items()})


@pytest.mark.parametrize(("case", "train", "evaluate", "needle"), CASES, ids=[c[0] for c in CASES])
def test_train_refuses_in_one_line_before_servers(inputs, tmp_path, capsys, case, train, evaluate, needle):
    if train is None:
        pytest.skip("not a train input")
    extra = {k: _fill(v, inputs) for k, v in train.items()}
    code = main(args_for(tmp_path, extra.pop("data.train_files", f"[{inputs['good_data']}]").strip("[]"), **extra))
    captured = capsys.readouterr()
    _one_line(code, captured.err, captured.out, needle)


@pytest.mark.parametrize(("case", "train", "evaluate", "needle"), CASES, ids=[c[0] for c in CASES])
def test_eval_refuses_in_one_line_before_servers(inputs, tmp_path, capsys, case, train, evaluate, needle):
    argv = [_fill(a, inputs) for a in evaluate]
    if "--data" not in argv:
        argv += ["--data", str(inputs["good_data"])]
    code = main(["eval", *argv, f"trainer.run_dir={tmp_path / 'runs'}"])
    captured = capsys.readouterr()
    _one_line(code, captured.err, captured.out, needle)


@pytest.mark.parametrize(("run", "needle"), [("bad_run_json", "run.json"), ("bad_config_yaml", "config.yaml")])
def test_resume_of_a_corrupt_run_folder_is_one_line(inputs, capsys, run, needle):
    code = main(["train", "--resume", str(inputs[run])])
    captured = capsys.readouterr()
    _one_line(code, captured.err, captured.out, needle)


def test_good_inputs_pass_the_checks(inputs, tmp_path):
    """The control: the inputs the bad ones were made from pass (so each case fails for its damage)."""
    from flows.preflight import preflight
    from flows.preflight_inputs import check_model
    from hybridflow.config import load_config

    argv = args_for(tmp_path, str(inputs["good_data"]), **{"model.path": str(inputs["good_model"])})[1:]
    preflight(load_config(None, argv))
    assert check_model("m", str(inputs["good_model"]), tokenizer=True) > 0
    ckpt = inputs["run"] / "checkpoints" / "iter_000003" / "policy"
    check_model("m", str(ckpt), tokenizer=True)
    assert safetensors_problem(inputs["good_model"] / "model.safetensors") is None
    from hybridflow.models.resolve import smollm2_gguf_path

    gguf = gguf_summary(smollm2_gguf_path())
    assert gguf.needed_bytes == smollm2_gguf_path().stat().st_size and gguf.parameters > 100_000_000


def test_full_disk_is_named_before_servers(inputs, tmp_path, capsys, monkeypatch):
    import flows.preflight_inputs as pi

    real = shutil.disk_usage
    monkeypatch.delenv("PREFECT_API_URL", raising=False)  # a local Prefect home is part of the need
    monkeypatch.setattr(pi.shutil, "disk_usage", lambda p: real(p)._replace(free=50 << 20))
    code = main(args_for(tmp_path, str(inputs["good_data"]), **{"model.path": str(inputs["good_model"])}))
    captured = capsys.readouterr()
    _one_line(code, captured.err, captured.out, "No space left on device")
    assert "Prefect home 128 MiB" in captured.err


# ---- for real: a read-only and a full run folder (a tmpfs in a private mount namespace) ---------
def _in_namespace(mount_opts: str, argv: list[str], folder: Path) -> subprocess.CompletedProcess:
    folder.mkdir(parents=True, exist_ok=True)
    script = f"mount -t tmpfs -o {mount_opts} hybridflow-test {folder} && exec \"$@\""
    cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", sys.executable, "-m", "flows.cli", *argv]
    if os.geteuid() != 0:
        cmd[1:1] = ["-r"]
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # a local server's home: in the folder
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)


def _needs_mounts() -> None:
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m" if os.geteuid() == 0 else "-rm", "true"],
                                                         capture_output=True).returncode != 0:  # fmt: skip
        pytest.skip("no mount namespace here to make a read-only / full folder")


@pytest.mark.parametrize(("opts", "needle"), [("ro,size=8m", "is not writable"), ("size=1m", "No space left")])
def test_read_only_and_full_run_folders_for_real(inputs, tmp_path, opts, needle):
    _needs_mounts()
    runs = tmp_path / "runs"
    argv = args_for(tmp_path, str(inputs["good_data"]), **{"model.path": str(inputs["good_model"])})
    res = _in_namespace(opts, argv, runs)
    _one_line(res.returncode, res.stderr, res.stdout, needle)
