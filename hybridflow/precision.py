"""The run's numeric precision: ``model.precision`` (Lightning's names) resolved once, by one function.

Names:

- ``fp32``: float32 parameters and compute (the default; today's ``model.dtype: float32``).
- ``bf16-mixed``: float32 master weights and optimizer state, the model's forward under
  ``torch.autocast(bfloat16)``; the chunked LM head's matmuls in bfloat16, losses and log-softmax
  float32 (as TRL's ``bf16=True``, FSDP2's ``MixedPrecisionPolicy``).
- ``bf16-true``: bfloat16 parameters (the old ``model.dtype: bfloat16``).
- ``fp16-true``: float16 parameters (the old ``model.dtype: float16``; GPU only, never chosen by auto).
- ``auto``: ``bf16-mixed`` on CUDA with bf16 support; on a CPU, ``bf16-mixed`` only where a short
  probe (:mod:`hybridflow.precision_probe`) measures a decoder-layer training step at least
  :data:`AUTO_MIN_SPEEDUP` times faster under autocast, else ``fp32``.

:func:`resolve_precision` is the one decision (pure: the probe's figures come in as an argument);
:func:`resolved_precision` is how every reader (model loading, value head, reward model, rollout
engines, workers) asks for it: the driver records the decision in ``model.resolved_precision``
(and in the run's run.json, so a resume reuses it) before any pool starts. Importing this module
does not import torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    import torch

    from hybridflow.config import ExperimentConfig, ModelConfig

PrecisionName = Literal["auto", "fp32", "bf16-mixed", "bf16-true", "fp16-true"]
ResolvedName = Literal["fp32", "bf16-mixed", "bf16-true", "fp16-true"]
DeviceType = Literal["cpu", "cuda"]

# model.dtype (deprecated) → model.precision
LEGACY_DTYPES: dict[str, str] = {"float32": "fp32", "bfloat16": "bf16-true", "float16": "fp16-true"}
_PARAM_DTYPE: dict[str, str] = {"fp32": "float32", "bf16-mixed": "float32", "bf16-true": "bfloat16",
                                "fp16-true": "float16"}
_AUTOCAST_DTYPE: dict[str, str | None] = {"fp32": None, "bf16-mixed": "bfloat16", "bf16-true": None,
                                          "fp16-true": None}
# auto picks bf16-mixed on a CPU only when the probed decoder-layer forward+backward is at least this
# many times faster under autocast than in float32 (a margin over the probe's run-to-run noise, ~5 %)
AUTO_MIN_SPEEDUP = 1.15


class PrecisionError(ValueError):
    """A precision the device cannot run (float16 on a CPU), formatted for humans."""


class ProbeFigures(BaseModel):
    """What the CPU probe measured (best of a few repeats each); see :mod:`hybridflow.precision_probe`.

    machine_key: CPU model | bf16 flags | torch version | threads | widths probed.
    *_matmul_gflops: a [rows, hidden] × [hidden, intermediate] matmul, GFLOP/s.
    *_layer_ms: one decoder-layer-shaped forward + backward on [rows, hidden], milliseconds
    (bf16: float32 weights under autocast). seconds: the probe's wall time.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    machine_key: str = Field(description="CPU model | bf16 flags | torch | threads | widths.")
    cpu_bf16: bool = Field(description="Whether the CPU has bf16 instructions (amx_bf16 / avx512_bf16).")
    hidden_size: int = Field(gt=0, description="Width probed (the model's hidden size).")
    fp32_matmul_gflops: float = Field(description="float32 matmul, GFLOP/s.")
    bf16_matmul_gflops: float = Field(description="bfloat16 matmul, GFLOP/s.")
    fp32_layer_ms: float = Field(description="float32 decoder-layer forward+backward, ms.")
    bf16_layer_ms: float = Field(description="autocast(bf16) decoder-layer forward+backward, ms.")
    seconds: float = Field(description="Wall time of the probe, s.")

    @property
    def layer_speedup(self) -> float:
        """fp32 time / bf16-mixed time of the layer step (> 1: bf16 is faster)."""
        return self.fp32_layer_ms / self.bf16_layer_ms


class ResolvedPrecision(BaseModel):
    """The run's precision decision (frozen; it travels in ``model.resolved_precision`` to every pool).

    name: the resolved precision; requested: what ``model.precision`` said; reason: one line of why;
    probe: the CPU probe's figures when one ran (auto on a CPU, or forced bf16 on a CPU without bf16).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: ResolvedName = Field(description="The precision the run uses.")
    requested: PrecisionName = Field(description="model.precision as configured.")
    reason: str = Field(description="Why this precision (one line).")
    probe: ProbeFigures | None = Field(None, description="The CPU probe's figures, when one ran.")

    @property
    def param_dtype(self) -> str:
        """"float32" | "bfloat16" | "float16": the dtype parameters (and optimizer state) are kept in."""
        return _PARAM_DTYPE[self.name]

    @property
    def autocast_dtype(self) -> str | None:
        """"bfloat16" under bf16-mixed (the forward's compute dtype), else None (no autocast)."""
        return _AUTOCAST_DTYPE[self.name]

    @property
    def head_matmul_dtype(self) -> str:
        """"bfloat16" under bf16-mixed and bf16-true, else "float32": the dtype of the chunked LM head's
        matmuls (:func:`hybridflow.algorithms.logits.log_probs_from_hidden`); its log-softmax is float32."""
        return "bfloat16" if self.name in ("bf16-mixed", "bf16-true") else "float32"

    def torch_param_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.param_dtype)

    @contextmanager
    def autocast(self, device_type: str) -> Iterator[None]:
        """``torch.autocast(device_type, bfloat16)`` under bf16-mixed, else nothing. Wrap the model's
        forward only: losses, log-softmax and the chunked LM head run outside it (the head's matmuls
        in :attr:`head_matmul_dtype`, its log-softmax in float32). On a CPU, attention over a
        sequence runs in float32 inside it (:mod:`hybridflow.cpu_attention`)."""
        if self.autocast_dtype is None:
            with nullcontext():
                yield
            return
        import torch

        if device_type == "cpu":  # sdpa in float32 there (faster backward on a CPU; hybridflow.cpu_attention)
            from hybridflow.cpu_attention import install

            install()
        with torch.autocast(device_type=device_type, dtype=getattr(torch, self.autocast_dtype)):
            yield

    def summary(self) -> dict[str, Any]:
        """Flat {key: value} for MLflow params and the run summary (``precision``, ``precision/...``)."""
        out: dict[str, Any] = {"precision": self.name, "precision/requested": self.requested,
                               "precision/reason": self.reason}
        if self.probe is not None:
            out |= {f"precision/probe/{k}": v for k, v in self.probe.model_dump().items()}
            out["precision/probe/layer_speedup"] = round(self.probe.layer_speedup, 3)
        return out


def _fixed(name: str, requested: str, reason: str, probe: ProbeFigures | None = None) -> ResolvedPrecision:
    return ResolvedPrecision(name=name, requested=requested, reason=reason, probe=probe)  # type: ignore[arg-type]


def resolve_precision(requested: str, *, device_type: DeviceType, cuda_bf16: bool = False,
                      probe: ProbeFigures | None = None) -> ResolvedPrecision:
    """The one precision decision (pure).

    requested: ``model.precision``; device_type: where the pools compute; cuda_bf16: the GPU
    supports bfloat16; probe: the CPU probe's figures (needed for auto on a CPU: without them auto
    is fp32). Raises PrecisionError for fp16-true on a CPU (naming the config keys).
    """
    if requested == "fp16-true" and device_type == "cpu":
        raise PrecisionError("model.precision=fp16-true (model.dtype: float16) is not supported on CPU: "
                             "use model.precision: fp32, bf16-mixed or auto")
    if requested != "auto":
        return _fixed(requested, requested, "set in model.precision", probe)
    if device_type == "cuda":
        if cuda_bf16:
            return _fixed("bf16-mixed", "auto", "auto: the GPU supports bfloat16 (no probe)")
        return _fixed("fp32", "auto", "auto: the GPU does not report bfloat16 support")
    if probe is None:
        return _fixed("fp32", "auto", "auto: no probe figures (decided without measuring)")
    speedup = probe.layer_speedup
    if speedup >= AUTO_MIN_SPEEDUP:
        return _fixed("bf16-mixed", "auto", f"auto: probe measured bf16-mixed {speedup:.2f}x fp32 "
                      f"(>= {AUTO_MIN_SPEEDUP}x)", probe)
    return _fixed("fp32", "auto", f"auto: probe measured bf16-mixed {speedup:.2f}x fp32 "
                  f"(< {AUTO_MIN_SPEEDUP}x)", probe)


def resolved_precision(cfg: ExperimentConfig) -> ResolvedPrecision:
    """The run's precision, as every reader asks for it.

    The driver's recorded decision (``cfg.model.resolved_precision``) when there is one; otherwise
    the configured name resolved without a probe (an unresolved ``auto`` outside a driver is fp32,
    never a probe in a worker). Raises PrecisionError as :func:`resolve_precision`.
    """
    if cfg.model.resolved_precision is not None:
        return cfg.model.resolved_precision
    return resolve_precision(cfg.model.precision, device_type=run_device_type(cfg))


def run_device_type(cfg: ExperimentConfig) -> DeviceType:
    """"cuda" when the pools compute on GPUs (trainer.device=cuda, or auto with a pool that has
    GPUs), else "cpu". From the config alone."""
    if cfg.trainer.device != "auto":
        return cfg.trainer.device  # type: ignore[return-value]
    return "cuda" if any(p.gpus_per_worker > 0 for p in cfg.placement.pools.values()) else "cpu"


def model_precision(model_cfg: ModelConfig) -> ResolvedPrecision:
    """:func:`resolved_precision` for a reader that holds only the ``model`` section (the loaders):
    the recorded decision, else the configured name without a probe and without a device check
    (the config and the driver refuse fp16-true on a CPU)."""
    if model_cfg.resolved_precision is not None:
        return model_cfg.resolved_precision
    return resolve_precision(model_cfg.precision, device_type="cuda", cuda_bf16=False)


def with_resolved_precision(cfg: ExperimentConfig, resolved: ResolvedPrecision) -> ExperimentConfig:
    """``cfg`` with ``model.resolved_precision`` set (what the driver hands the pools), its
    precision-dependent checks run again (``rollout.dtype: auto`` and ``actor.rollout_correction: auto``
    follow the decision). Raises ValueError where the decision makes the config invalid."""
    out = cfg.model_copy(update={"model": cfg.model.model_copy(update={"resolved_precision": resolved})})
    out.check_resolved()
    return out


__all__ = [
    "AUTO_MIN_SPEEDUP",
    "LEGACY_DTYPES",
    "PrecisionError",
    "PrecisionName",
    "ProbeFigures",
    "ResolvedPrecision",
    "model_precision",
    "resolve_precision",
    "resolved_precision",
    "run_device_type",
    "with_resolved_precision",
]
