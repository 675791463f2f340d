"""rollout.dtype: auto and actor.rollout_correction: auto (issue 41): both follow the resolved
precision, also once the driver decides model.precision: auto (with_resolved_precision), and every
reader sees the resolved value."""

import pytest

from hybridflow.config import ExperimentConfig
from hybridflow.precision import ProbeFigures, resolve_precision, with_resolved_precision


def _cfg(precision: str, engine: str = "vllm", **actor) -> ExperimentConfig:
    return ExperimentConfig(model={"precision": precision}, trainer={"device": "cpu"},
                            rollout={"engine": engine, "dtype": "auto"}, actor=actor)


@pytest.mark.parametrize("precision, rollout, corr, from_rollout", [
    ("fp32", "float32", "none", False),       # vllm: another engine, recomputed anyway
    ("bf16-mixed", "bfloat16", "tis", False),
    ("bf16-true", "bfloat16", "none", False),
])
def test_auto_follows_the_precision(precision, rollout, corr, from_rollout):
    cfg = _cfg(precision, rollout_correction="auto")
    assert (cfg.rollout_dtype, cfg.rollout_correction, cfg.old_log_probs_from_rollout) == (rollout, corr, from_rollout)


def test_explicit_values_are_unchanged():
    cfg = ExperimentConfig(rollout={"engine": "vllm", "dtype": "bfloat16"}, trainer={"device": "cpu"})
    assert (cfg.rollout_dtype, cfg.rollout_correction) == ("bfloat16", "none")  # correction default stays none
    tis = ExperimentConfig(rollout={"engine": "vllm"}, actor={"rollout_correction": "tis"})
    assert (tis.rollout_dtype, tis.rollout_correction) == ("float32", "tis")


def test_auto_is_resolved_again_with_the_drivers_decision():
    cfg = _cfg("auto", rollout_correction="auto")
    assert (cfg.rollout_dtype, cfg.rollout_correction) == ("float32", "none")  # undecided auto = fp32
    probe = ProbeFigures(machine_key="k", cpu_bf16=True, hidden_size=64, fp32_matmul_gflops=1.0,
                         bf16_matmul_gflops=3.0, fp32_layer_ms=20.0, bf16_layer_ms=10.0, seconds=1.0)
    run = with_resolved_precision(cfg, resolve_precision("auto", device_type="cpu", probe=probe))
    assert (run.rollout_dtype, run.rollout_correction) == ("bfloat16", "tis")
    assert not run.old_log_probs_from_rollout


def test_auto_correction_with_rollout_old_log_probs_is_refused():
    with pytest.raises(ValueError, match="rollout_correction=auto needs recomputed old_log_probs.*=none"):
        _cfg("fp32", rollout_correction="auto", old_log_probs="rollout")


def test_the_policy_worker_reads_the_resolved_correction():
    import inspect

    import workers.policy as policy

    src = inspect.getsource(policy)
    assert "a.rollout_correction" not in src and "actor.rollout_correction !=" not in src
    assert "self.cfg.rollout_correction" in src
