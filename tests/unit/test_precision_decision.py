"""auto decided once per run (issue 41): the probe's cache per machine key, the driver's decision
recorded in run.json (not config.yaml), a resume reusing it without probing, and the forced-bf16
warning on a CPU without bf16 instructions."""

from __future__ import annotations

import json

import pytest

import hybridflow.precision_probe as probe_mod
from flows.run_state import open_run
from hybridflow.config import load_config
from hybridflow.data import write_rows
from hybridflow.data.tasks import make_arith
from hybridflow.precision import ProbeFigures, resolved_precision


def _figures(speedup: float, cpu_bf16: bool = True) -> ProbeFigures:
    return ProbeFigures(machine_key="k", cpu_bf16=cpu_bf16, hidden_size=32, fp32_matmul_gflops=1.0,
                        bf16_matmul_gflops=2.0, fp32_layer_ms=speedup, bf16_layer_ms=1.0, seconds=0.1)


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path / "cache"))
    train = tmp_path / "train.jsonl"
    write_rows(make_arith(6, difficulty=0, seed=3), str(train))
    return load_config(None, [
        "model.path=tiny", "model.precision=auto", f"data.train_files=[{train}]", "data.prompts_per_iteration=2",
        "rollout.samples_per_prompt=2", "actor.mini_batch_trajectories=4", "actor.micro_batch_trajectories=2",
        f"trainer.run_dir={tmp_path / 'runs'}", "trainer.run_id=r", "trainer.total_iterations=3",
        "trainer.device=cpu",
    ])


def test_the_probe_measures_and_is_cached_per_machine_key(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path))
    calls = []
    real = probe_mod.probe_cpu
    monkeypatch.setattr(probe_mod, "probe_cpu", lambda h, i: calls.append((h, i)) or real(h, i, repeats=1, rows=16))
    first = probe_mod.cached_probe(32, 64)
    assert first.fp32_layer_ms > 0 and first.bf16_matmul_gflops > 0 and first.hidden_size == 32
    assert probe_mod.cached_probe(32, 64) == first and calls == [(32, 64)]  # the second is read, not measured
    key = probe_mod.machine_key(32, 64)
    assert "torch" in key and "threads" in key and key.endswith("32x64")
    assert json.loads(probe_mod.probe_cache_file(key).read_text())["machine_key"] == key
    assert probe_mod.probe_cache_file(key).parent == tmp_path / "precision"


def test_a_run_decides_once_records_in_run_json_and_a_resume_reuses_it(cfg, monkeypatch):
    monkeypatch.setattr(probe_mod, "cached_probe", lambda h, i: _figures(2.0))
    state = open_run(cfg, resume=None)
    assert resolved_precision(state.cfg).name == "bf16-mixed"
    info = json.loads(open(state.dir.run_info_file).read())
    assert info["precision"]["name"] == "bf16-mixed" and info["precision"]["probe"]["fp32_layer_ms"] == 2.0
    assert "resolved_precision" not in open(state.dir.config_file).read()
    assert state.summary()["precision"]["name"] == "bf16-mixed"
    state.close()

    def no_probe(h, i):
        raise AssertionError("a resume must not probe")

    monkeypatch.setattr(probe_mod, "cached_probe", no_probe)  # this "machine" would also decide otherwise
    again = open_run(cfg, resume=state.run_dir)
    assert again.cfg.model.resolved_precision == state.cfg.model.resolved_precision
    again.close()


def test_an_explicit_precision_does_not_probe(cfg, monkeypatch):
    monkeypatch.setattr(probe_mod, "cpu_description", lambda: ("cpu", ("amx_bf16",)))
    monkeypatch.setattr(probe_mod, "cached_probe", lambda h, i: pytest.fail("probed"))
    for name in ("fp32", "bf16-mixed", "bf16-true"):
        picked = cfg.model_copy(update={"model": cfg.model.model_copy(update={"precision": name})})
        assert probe_mod.decide_precision(picked).name == name


def test_forced_bf16_on_a_cpu_without_bf16_warns_with_the_slowdown(cfg, monkeypatch):
    monkeypatch.setattr(probe_mod, "cpu_description", lambda: ("Old CPU", ()))
    monkeypatch.setattr(probe_mod, "cached_probe", lambda h, i: _figures(0.25, cpu_bf16=False))
    forced = cfg.model_copy(update={"model": cfg.model.model_copy(update={"precision": "bf16-mixed"})})
    with pytest.warns(RuntimeWarning, match=r"without bf16 instructions.*4\.00x slower"):
        assert probe_mod.decide_precision(forced).name == "bf16-mixed"
    assert probe_mod.decide_precision(cfg).name == "fp32"  # auto on that CPU: the probe says no


def test_an_override_of_model_precision_on_resume_keeps_the_recorded_decision(cfg, monkeypatch, capsys):
    monkeypatch.setattr(probe_mod, "cached_probe", lambda h, i: _figures(2.0))
    state = open_run(cfg, resume=None)
    state.dir.write_config(cfg.model_copy(update={"model": cfg.model.model_copy(update={"precision": "fp32"})}))
    state.close()
    again = open_run(cfg, resume=state.run_dir)
    assert resolved_precision(again.cfg).name == "bf16-mixed"
    assert "never switches precision; keeping bf16-mixed" in capsys.readouterr().err
    again.close()


def test_a_run_recorded_before_precisions_gets_its_configured_one(cfg, monkeypatch):
    fixed = cfg.model_copy(update={"model": cfg.model.model_copy(update={"precision": "fp32"})})
    state = open_run(fixed, resume=None)
    info = json.loads(open(state.dir.run_info_file).read())
    del info["precision"]
    open(state.dir.run_info_file, "w").write(json.dumps(info))
    state.close()
    again = open_run(fixed, resume=state.run_dir)
    assert resolved_precision(again.cfg).name == "fp32"
    assert json.loads(open(state.dir.run_info_file).read())["precision"]["name"] == "fp32"
    again.close()
