"""model.precision and its one resolver (issue 41): names, the deprecated model.dtype alias, float16
refused on a CPU, auto's rule, and the decision travelling in the config the pools receive."""

import pytest

from hybridflow.config import ExperimentConfig, config_from_dict, dump_config, load_config
from hybridflow.precision import (
    AUTO_MIN_SPEEDUP,
    PrecisionError,
    ProbeFigures,
    resolve_precision,
    resolved_precision,
    with_resolved_precision,
)


def _probe(speedup: float) -> ProbeFigures:
    return ProbeFigures(machine_key="k", cpu_bf16=True, hidden_size=64, fp32_matmul_gflops=100.0,
                        bf16_matmul_gflops=300.0, fp32_layer_ms=10.0 * speedup, bf16_layer_ms=10.0, seconds=1.0)


@pytest.mark.parametrize("name, param, autocast, head", [
    ("fp32", "float32", None, "float32"),
    ("bf16-mixed", "float32", "bfloat16", "bfloat16"),
    ("bf16-true", "bfloat16", None, "bfloat16"),
])
def test_each_explicit_name_maps_to_its_dtypes(name, param, autocast, head):
    r = resolve_precision(name, device_type="cpu")
    assert (r.name, r.requested, r.param_dtype, r.autocast_dtype, r.head_matmul_dtype) == (
        name, name, param, autocast, head)


def test_fp16_is_refused_on_cpu_naming_the_key():
    with pytest.raises(PrecisionError, match="model.precision=fp16-true.*model.dtype: float16.*CPU"):
        resolve_precision("fp16-true", device_type="cpu")
    assert resolve_precision("fp16-true", device_type="cuda").param_dtype == "float16"
    with pytest.raises(ValueError, match="model.dtype: float16.*not supported on CPU"):
        ExperimentConfig(model={"dtype": "float16"}, trainer={"device": "cpu"})


def test_auto_on_cuda_is_bf16_mixed_without_a_probe():
    r = resolve_precision("auto", device_type="cuda", cuda_bf16=True)
    assert (r.name, r.probe) == ("bf16-mixed", None)
    assert resolve_precision("auto", device_type="cuda", cuda_bf16=False).name == "fp32"


def test_auto_on_cpu_follows_the_probe_threshold():
    assert resolve_precision("auto", device_type="cpu", probe=_probe(AUTO_MIN_SPEEDUP + 0.01)).name == "bf16-mixed"
    slow = resolve_precision("auto", device_type="cpu", probe=_probe(AUTO_MIN_SPEEDUP - 0.01))
    assert slow.name == "fp32" and slow.probe is not None and "<" in slow.reason
    assert resolve_precision("auto", device_type="cpu").name == "fp32"  # no figures: never guess bf16


def test_default_is_fp32_and_the_legacy_dtype_maps():
    assert ExperimentConfig().model.precision == "fp32"
    for old, new in {"float32": "fp32", "bfloat16": "bf16-true"}.items():
        with pytest.warns(FutureWarning, match="model.dtype is deprecated.*model.precision"):
            cfg = ExperimentConfig(model={"dtype": old})
        assert cfg.model.precision == new
        assert resolved_precision(cfg).name == new
    with pytest.raises(ValueError, match="both set"):
        ExperimentConfig(model={"dtype": "float32", "precision": "fp32"})


def test_the_decision_reaches_the_workers_config_but_not_config_yaml(tmp_path):
    cfg = ExperimentConfig(model={"precision": "auto"})
    decided = resolve_precision("auto", device_type="cpu", probe=_probe(2.0))
    run_cfg = with_resolved_precision(cfg, decided)
    # what a pool rank receives (workers/pool.py sends model_dump(mode="json"))
    rank_cfg = config_from_dict(run_cfg.model_dump(mode="json"))
    assert resolved_precision(rank_cfg) == decided and resolved_precision(rank_cfg).name == "bf16-mixed"
    text = dump_config(run_cfg)
    assert "resolved_precision" not in text
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert load_config(str(path)).model.resolved_precision is None


def test_summary_has_the_probe_figures():
    s = resolve_precision("auto", device_type="cpu", probe=_probe(2.0)).summary()
    assert s["precision"] == "bf16-mixed" and s["precision/probe/layer_speedup"] == 2.0
    assert s["precision/probe/bf16_matmul_gflops"] == 300.0


def test_the_decision_is_in_the_mlflow_params():
    from hybridflow.config import flatten_config

    decided = resolve_precision("auto", device_type="cpu", probe=_probe(2.0))
    flat = flatten_config(with_resolved_precision(ExperimentConfig(model={"precision": "auto"}), decided))
    assert flat["model.precision"] == "auto" and flat["model.resolved_precision.name"] == "bf16-mixed"
    assert flat["model.resolved_precision.probe.fp32_layer_ms"] == 20.0


def test_fp16_with_device_auto_follows_the_pools():
    with pytest.raises(ValueError, match="fp16-true.*not supported on CPU.*no pool with GPUs"):
        ExperimentConfig(model={"precision": "fp16-true"})  # trainer.device auto, CPU pools
    pools = {"main": {"workers": 1, "gpus_per_worker": 1, "roles": ["policy", "reward"]}}
    gpu = ExperimentConfig(model={"precision": "fp16-true"}, placement={"pools": pools})
    assert resolved_precision(gpu).param_dtype == "float16"
