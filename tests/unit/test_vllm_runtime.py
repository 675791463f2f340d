"""The vLLM runtime seam, in the default runtime (no vllm needed): which pools run on it, what must
match between the two interpreters, the preflight's one-line refusals, and the config rules of
vLLM's CPU build. The engine itself is tested inside the runtime by ``make test-vllm`` (tests/vllm)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hybridflow.config import ExperimentConfig, load_config
from workers.vllm_runtime import RuntimeInfo, pool_uses_vllm, runtime_mismatch, vllm_runtime_env

ROOT = Path(__file__).resolve().parents[2]
HERE = RuntimeInfo("/a/python", "3.11.9", {"torch": "2.13.0", "ray": "2.60.0", "numpy": "2.3.5"},
                   "/repo/hybridflow/__init__.py", "/repo/workers/__init__.py", None, None)


def _vllm_cfg(**over) -> ExperimentConfig:
    return load_config(ROOT / "examples" / "grpo_arith_vllm.yaml", [f"{k}={v}" for k, v in over.items()])


def test_runtime_mismatch_names_the_first_difference():
    there = replace(HERE, python="/b/python", vllm="0.32.0")
    assert runtime_mismatch(HERE, there) is None
    assert runtime_mismatch(HERE, replace(there, versions={**HERE.versions, "numpy": "2.4.6"})) == (
        "numpy 2.4.6 in the vLLM runtime, 2.3.5 here")
    assert "Python 3.12.1" in runtime_mismatch(HERE, replace(there, version="3.12.1"))
    assert "imports hybridflow from /other" in runtime_mismatch(HERE, replace(there, hybridflow="/other/__init__.py"))
    assert runtime_mismatch(HERE, replace(HERE, python="/b/python")) == "vllm is not installed in it"


def test_only_pools_holding_a_vllm_engine_run_on_the_vllm_runtime(monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_VLLM_PYTHON", "/opt/vllm/bin/python")
    cfg = _vllm_cfg()
    assert pool_uses_vllm(cfg, ["policy", "reference"]) and pool_uses_vllm(cfg, ["rollout"])
    assert not pool_uses_vllm(cfg, ["reward"]) and not pool_uses_vllm(cfg, ["critic"])
    env = vllm_runtime_env(cfg, ["policy"], on_cpu=True)
    assert env["py_executable"] == "/opt/vllm/bin/python"
    assert env["env_vars"] == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    assert vllm_runtime_env(cfg, ["reward"], on_cpu=True) == {}
    hf = load_config(ROOT / "examples" / "grpo_arith.yaml")
    assert vllm_runtime_env(hf, ["policy"], on_cpu=True) == {}


def test_config_rules_of_vllms_cpu_build():
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        _vllm_cfg(**{"rollout.tensor_parallel_size": 2, "trainer.device": "cpu"})
    with pytest.raises(ValueError, match="float16"):
        _vllm_cfg(**{"rollout.dtype": "float16", "trainer.device": "cpu"})
    with pytest.raises(ValueError, match="hf engine generates in the trainer's dtype, or in bfloat16"):
        load_config(ROOT / "examples" / "grpo_arith.yaml", ["rollout.dtype=float16"])
    # trainer.device=auto is decided by the machine: the same rule, asked by the vLLM preflight
    auto = _vllm_cfg(**{"rollout.tensor_parallel_size": 2})
    assert auto.vllm_cpu_problem().startswith("rollout.tensor_parallel_size=2: vLLM on a CPU")
    assert _vllm_cfg().vllm_cpu_problem() is None
    # issue 41: the hf engine generates in bfloat16 against float32 parameters (then recomputes)
    hf_bf16 = load_config(ROOT / "examples" / "grpo_arith.yaml", ["rollout.dtype=bfloat16"])
    assert hf_bf16.rollout_dtype == "bfloat16" and not hf_bf16.old_log_probs_from_rollout


def test_old_log_probs_are_recomputed_when_the_engine_or_dtype_differs():
    hf = load_config(ROOT / "examples" / "grpo_arith.yaml")
    assert hf.old_log_probs_from_rollout and hf.rollout_dtype == "float32"
    assert not _vllm_cfg().old_log_probs_from_rollout  # another engine: other numbers
    assert _vllm_cfg(**{"rollout.dtype": "bfloat16"}).rollout_dtype == "bfloat16"
    assert _vllm_cfg().rollout_max_model_len == 128 + 48  # single-turn: prompt + response budget
    assert _vllm_cfg(**{"rollout.max_model_len": 1000}).rollout_max_model_len == 1000


def test_kv_cache_too_small_or_larger_than_free_ram():
    from types import SimpleNamespace

    from flows.preflight_vllm import kv_cache_problem, missing_cpu_flag

    smol = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, hidden_size=576, num_hidden_layers=30,
                           max_position_embeddings=8192)
    gib = 1 << 30
    ok = _vllm_cfg()
    assert kv_cache_problem(ok, smol, 16 * gib) is None
    small = _vllm_cfg(**{"rollout.kv_cache_gib": 0.001})  # 1 MiB < 176 tokens × 46 KB
    assert "holds less than one sequence of 176 tokens" in kv_cache_problem(small, smol, 16 * gib)
    assert "more than the free RAM" in kv_cache_problem(ok, smol, gib // 2)
    assert missing_cpu_flag({"sse4_2", "avx"}, "x86_64") == "avx2"
    assert missing_cpu_flag({"avx2", "avx512f"}, "x86_64") is None


@pytest.mark.parametrize("extra, says", [
    ([], "make setup-vllm"),  # no runtime at HYBRIDFLOW_VLLM_PYTHON
    (["rollout.kv_cache_gib=0.00001"], "holds less than one sequence of 448 tokens"),
    (["rollout.kv_cache_gib=100000"], "more than the free RAM"),
])
def test_bad_vllm_input_is_one_line_rc_2_and_starts_nothing(tmp_path, extra, says):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HYBRIDFLOW_VLLM_PYTHON": str(tmp_path / "none" / "python")}
    env.pop("RAY_ADDRESS", None)
    script = Path(sys.executable).with_name("hybridflow")
    proc = subprocess.run([str(script), "train", "-c", str(ROOT / "examples" / "grpo_arith_vllm.yaml"),
                           "model.path=tiny", "model.tiny_hidden_size=128", "data.max_prompt_tokens=400",
                           "data.train_files=[x.parquet]", "data.val_files=[x.parquet]", *extra],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(lines) == 1 and says in lines[0], lines
    assert not (tmp_path / "runs" / ".prefect").exists() and not (tmp_path / "mlflow.db").exists()
