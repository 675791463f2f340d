"""Broken storage is a clear error: checkpoints carry a manifest (sizes + sha256, written last); a
resume verifies the step it loads and falls back to the newest intact one (or refuses, with
``trainer.resume_fallback=false``); an export of a damaged step leaves nothing; a full disk or an
I/O error while a worker writes is one CheckpointError naming the folder, ``latest`` untouched."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
from pathlib import Path

import pytest

from flows.cli import main
from tests.unit.test_reliability_inputs import args_for, good_data, no_servers, run_cli  # noqa: F401 - fixtures
from workers import checkpoint as C
from workers.checkpoint_integrity import (
    MANIFEST,
    CheckpointDamagedError,
    choose_resume_checkpoint,
    verify_checkpoint,
)


def _one_line(err: str) -> str:
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


@pytest.fixture
def run_with_two_steps(tmp_path, good_data):  # noqa: F811
    """A run folder (config.yaml, run.json) with tiny-model checkpoints at steps 1 and 2."""
    from hybridflow.config import dump_config, load_config
    from hybridflow.models import save_hf_checkpoint
    from hybridflow.models.tiny import build_tiny_model, build_tiny_tokenizer

    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    cfg = load_config(None, args_for(tmp_path, good_data, **{"trainer.run_id": "r"})[1:])
    (run / "config.yaml").write_text(dump_config(cfg))
    (run / "run.json").write_text(json.dumps({"run_id": "r"}))
    tok = build_tiny_tokenizer()
    for step in (1, 2):
        tmp = C.begin_save(run / "checkpoints", step)
        save_hf_checkpoint(build_tiny_model(len(tok), hidden_size=16, layers=1, seed=step), tok, Path(tmp) / "policy")
        C.commit_save(run / "checkpoints", step, {"iteration": step, "policy_version": step})
    return run


# ---- the manifest -------------------------------------------------------------------------------
def test_manifest_is_written_last_and_catches_every_kind_of_damage(run_with_two_steps):
    step = run_with_two_steps / "checkpoints" / C.checkpoint_name(2)
    listed = json.loads((step / MANIFEST).read_text())["files"]
    assert {"trainer_state.json", "policy/model.safetensors", "policy/config.json"} <= set(listed)
    verify_checkpoint(step)
    weights = step / "policy" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, one bit flipped
    with pytest.raises(CheckpointDamagedError, match="model.safetensors does not match its sha256"):
        verify_checkpoint(step)
    verify_checkpoint(step, hashes=False)  # sizes alone do not see it
    weights.write_bytes(data)
    _truncate(weights)
    with pytest.raises(CheckpointDamagedError, match=f"model.safetensors is {len(data) // 2} bytes, its manifest says {len(data)}"):
        verify_checkpoint(step)
    weights.write_bytes(data)
    (step / "policy" / "pytorch_model.bin").write_bytes(b"planted")
    with pytest.raises(CheckpointDamagedError, match="pytorch_model.bin is not in its manifest"):
        verify_checkpoint(step)
    (step / "policy" / "pytorch_model.bin").unlink()
    (step / "trainer_state.json").unlink()
    with pytest.raises(CheckpointDamagedError, match="trainer_state.json is missing"):
        verify_checkpoint(step)


def test_resume_checkpoint_falls_back_or_refuses(run_with_two_steps):
    root = run_with_two_steps / "checkpoints"
    warnings: list[str] = []
    assert choose_resume_checkpoint(root, fallback=True, warn=warnings.append) == str(root / C.checkpoint_name(2))
    _truncate(root / C.checkpoint_name(2) / "policy" / "model.safetensors")
    with pytest.raises(C.CheckpointError, match=f"{C.checkpoint_name(2)} is damaged.*trainer.resume_fallback=false"):
        choose_resume_checkpoint(root, fallback=False, warn=warnings.append)
    assert (root / "latest").read_text() == C.checkpoint_name(2) and not warnings  # refusing changes nothing
    assert choose_resume_checkpoint(root, fallback=True, warn=warnings.append) == str(root / C.checkpoint_name(1))
    assert (root / "latest").read_text() == C.checkpoint_name(1) and (root / f"{C.checkpoint_name(2)}.damaged").is_dir()
    assert C.load_latest(root) == str(root / C.checkpoint_name(1))  # what the pools' workers restore
    _truncate(root / C.checkpoint_name(1) / "policy" / "model.safetensors")
    with pytest.raises(C.CheckpointError, match="no older intact checkpoint"):
        choose_resume_checkpoint(root, fallback=True, warn=warnings.append)


# ---- through the CLI ----------------------------------------------------------------------------
def test_resume_of_a_truncated_step_warns_and_falls_back_before_servers(run_with_two_steps, capsys, no_servers):  # noqa: F811
    root = run_with_two_steps / "checkpoints"
    _truncate(root / C.checkpoint_name(2) / "policy" / "model.safetensors")
    code, err = run_cli(["train", "--resume", str(run_with_two_steps), "trainer.resume_fallback=false"], capsys)
    line = _one_line(err)
    assert code == 2 and f"{C.checkpoint_name(2)} is damaged: policy/model.safetensors is" in line
    assert (root / "latest").read_text() == C.checkpoint_name(2)
    with pytest.raises(AssertionError, match="a server was started"):  # the fallback goes on to the servers
        main(["train", "--resume", str(run_with_two_steps)])
    warning = _one_line(capsys.readouterr().err)
    assert warning.startswith("warning: checkpoint ") and f"{C.checkpoint_name(2)} is damaged" in warning
    assert (f"resuming from the newest intact checkpoint {C.checkpoint_name(1)} "
            f"(the damaged one is kept as {C.checkpoint_name(2)}.damaged)") in warning
    assert (root / "latest").read_text() == C.checkpoint_name(1)


def test_export_of_a_damaged_step_leaves_nothing(run_with_two_steps, tmp_path, capsys):
    _truncate(run_with_two_steps / "checkpoints" / C.checkpoint_name(2) / "policy" / "model.safetensors")
    out = tmp_path / "exported"
    code, err = run_cli(["export", str(run_with_two_steps), "--step", "2", str(out)], capsys)
    line = _one_line(err)
    assert code == 2 and f"{C.checkpoint_name(2)} is damaged: policy/model.safetensors is" in line and "steps saved: 1, 2" in line
    assert sorted(os.listdir(tmp_path)) == sorted({"runs", "train.jsonl"})  # no OUT_DIR, no temporary folder
    assert main(["export", str(run_with_two_steps), "--step", "1", str(out), "--no-load-check"]) == 0


def test_export_that_fails_while_writing_leaves_nothing(run_with_two_steps, tmp_path, capsys, monkeypatch):
    import flows.export

    def disk_full(folder):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(flows.export, "_ensure_generation_config", disk_full)
    out = tmp_path / "exported"
    code, err = run_cli(["export", str(run_with_two_steps), str(out)], capsys)
    assert code == 1 and f"cannot write {out}: No space left on device; nothing was exported" in _one_line(err)
    assert sorted(os.listdir(tmp_path)) == sorted({"runs", "train.jsonl"})


# ---- write errors while a worker saves ----------------------------------------------------------
@pytest.fixture(scope="module")
def worker():
    from tests.unit._worker_helpers import tiny_cfg
    from workers.policy import PolicyWorker

    return PolicyWorker(tiny_cfg())


def _rust_io_error(code: int):
    """What safetensors' Rust writer raises for an OS error (its message format)."""
    from safetensors import SafetensorError

    def fail(*args, **kwargs):
        text = os.strerror(code)
        raise SafetensorError(f'Error while serializing: IoError(Os {{ code: {code}, kind: Other, message: "{text}" }})')

    return fail


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
@pytest.mark.parametrize("where", ["weights", "optimizer"])
def test_disk_full_or_io_error_is_one_checkpoint_error(worker, tmp_path, monkeypatch, code, where):
    import transformers.modeling_utils

    root = tmp_path / "checkpoints"
    worker.save_checkpoint(C.begin_save(root, 1))
    first = C.commit_save(root, 1, {"policy_version": 0})
    if where == "weights":  # save_pretrained writes model.safetensors with safetensors' save_file
        monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", _rust_io_error(code))
    else:  # the optimizer state (workers.checkpoint.save_state)
        monkeypatch.setattr(C, "save_file", _rust_io_error(code))
    tmp = C.begin_save(root, 2)
    with pytest.raises(C.CheckpointError) as info:
        worker.save_checkpoint(tmp)
    message = str(info.value)
    assert message.startswith("policy rank 0: cannot write checkpoint to ") and f"{C.checkpoint_name(2)}.tmp" in message
    assert message.endswith(os.strerror(code)) and "\n" not in message and "IoError" not in message
    monkeypatch.undo()
    assert C.load_latest(root) == first and (root / C.LATEST).read_text() == C.checkpoint_name(1)
    verify_checkpoint(first)


def test_a_real_write_failure_in_the_rust_writer_is_a_checkpoint_error(worker, tmp_path):
    """The kernel refuses the write (RLIMIT_FSIZE: EFBIG, as a full disk refuses with ENOSPC)
    inside safetensors' own writer, not a monkeypatched function."""
    root = tmp_path / "checkpoints"
    tmp = C.begin_save(root, 1)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # this process may write files of 4 KiB
    try:
        with pytest.raises(C.CheckpointError, match=f"cannot write checkpoint to .*{C.checkpoint_name(1)}.tmp.*File too large"):
            worker.save_checkpoint(tmp)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert C.load_latest(root) is None


def test_cli_prints_a_checkpoint_error_from_a_ray_task_in_one_line(tmp_path, good_data, capsys, monkeypatch):  # noqa: F811
    """A pool actor's CheckpointError reaches the driver as RayTaskError(CheckpointError), re-raised
    by Prefect from the checkpoint task: the CLI prints the worker's message in one line, exit 1."""
    from ray.exceptions import RayTaskError

    import flows.cli.train

    cause = C.CheckpointError("policy rank 0: cannot write checkpoint to /r/checkpoints/step_000002.tmp: "
                              "No space left on device")
    wrapped = RayTaskError("WorkerHost.call", "Traceback (most recent call last):\n  ...", cause).as_instanceof_cause()

    def failing_run(args, cfg, resume):
        try:
            raise wrapped
        except Exception as e:
            raise RuntimeError("Task run 'checkpoint-000002' failed") from e

    monkeypatch.setattr(flows.cli.train, "_train_with_servers", failing_run)
    code, err = run_cli(args_for(tmp_path, good_data), capsys)
    assert code == 1
    assert _one_line(err) == f"error: {cause}"
