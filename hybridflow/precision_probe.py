"""The CPU probe behind ``model.precision: auto``, and the driver's once-per-run decision.

:func:`probe_cpu` times, at the model's widths, a [rows, hidden] × [hidden, intermediate] matmul in
float32 and bfloat16, and one decoder-layer-shaped forward + backward (attention projections and a
gated MLP, float32 weights) in float32 and under ``autocast(bfloat16)``; best of ``repeats`` each,
about a second in total on a 2-core CPU at SmolLM2-135M's widths. :func:`cached_probe` keeps the
figures per machine key (CPU model, bf16 flags, torch version, threads, widths) as JSON under
``<cache_root>/precision/`` (the GGUF cache's root, ``$HYBRIDFLOW_CACHE`` or ~/.cache/hybridflow).
:func:`decide_precision` is what the driver calls before any pool starts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from hybridflow.config import ExperimentConfig
from hybridflow.precision import ProbeFigures, ResolvedPrecision, resolve_precision, run_device_type

_log = logging.getLogger("hybridflow.precision")
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
PROBE_ROWS = 256  # tokens per probed step (a micro-batch of 8 × 32, or 1 × 256)


def cpu_description() -> tuple[str, tuple[str, ...]]:
    """(CPU model name, the bf16 flags it has among :data:`BF16_FLAGS`) from /proc/cpuinfo
    (platform.processor() and no flags where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown", ()
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "unknown")
    flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))
    return name, tuple(f for f in BF16_FLAGS if f in flags)


def machine_key(hidden: int, intermediate: int) -> str:
    """``<cpu model>|<bf16 flags>|torch <version>|threads <n>|<hidden>x<intermediate>``."""
    name, flags = cpu_description()
    return f"{name}|{','.join(flags) or 'no-bf16'}|torch {torch.__version__}|threads {torch.get_num_threads()}|" \
           f"{hidden}x{intermediate}"


def _best_ms(fns: tuple[Callable[[], object], Callable[[], object]], repeats: int) -> tuple[float, float]:
    """Best wall time (ms) of each of two functions, run alternately after one warm-up each, so a
    burst of load from another process hits both alike."""
    for fn in fns:
        fn()  # warm-up (allocations, oneDNN kernel choice)
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best[0] * 1e3, best[1] * 1e3


class _Layer(nn.Module):
    """A decoder layer's matmuls: q/k/v/o projections and a gated MLP (no attention scores: they
    are a small share at these lengths and not what precision changes most)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.qkv, self.o = nn.Linear(hidden, 3 * hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        x = x + self.o(q * torch.sigmoid(k) + v)
        g, u = self.gate_up(x).chunk(2, -1)
        return x + self.down(nn.functional.silu(g) * u)


def _sig(value: float) -> float:
    """Four significant digits: a tiny probe's 0.04 GFLOP/s must not round to 0 (a fixed number of
    decimals did, on a loaded machine)."""
    return float(f"{value:.4g}")


def probe_cpu(hidden: int, intermediate: int, *, repeats: int = 5, rows: int = PROBE_ROWS) -> ProbeFigures:
    """Measure fp32 vs bf16 at these widths on this CPU (see the module docstring). Seeded, no
    global state changed. Takes about a second at hidden 576."""
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(rows * 2, hidden, generator=gen), torch.randn(hidden, intermediate, generator=gen)
    a16, b16 = a.bfloat16(), b.bfloat16()
    flop = 2.0 * rows * 2 * hidden * intermediate
    fp32_mm, bf16_mm = _best_ms((lambda: a @ b, lambda: a16 @ b16), repeats * 2)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        layer = _Layer(hidden, intermediate)
    x = torch.randn(rows, hidden, generator=gen)

    def step(autocast: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = layer(x)
        out.float().square().mean().backward()
        layer.zero_grad(set_to_none=True)

    fp32_layer, bf16_layer = _best_ms((lambda: step(False), lambda: step(True)), repeats)
    _, flags = cpu_description()
    return ProbeFigures(machine_key=machine_key(hidden, intermediate), cpu_bf16=bool(flags), hidden_size=hidden,
                        fp32_matmul_gflops=_sig(flop / fp32_mm / 1e6), bf16_matmul_gflops=_sig(flop / bf16_mm / 1e6),
                        fp32_layer_ms=_sig(fp32_layer), bf16_layer_ms=_sig(bf16_layer),
                        seconds=round(time.perf_counter() - t0, 3))


def probe_cache_file(key: str) -> Path:
    """``<cache_root>/precision/<sha256(key)[:16]>.json``."""
    from hybridflow.cache import cache_root

    return cache_root() / "precision" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def cached_probe(hidden: int, intermediate: int) -> ProbeFigures:
    """The probe's figures for this machine and widths: from the cache when there, else measured
    and cached (written atomically; an unreadable cache entry is measured again)."""
    path = probe_cache_file(machine_key(hidden, intermediate))
    try:
        return ProbeFigures.model_validate(json.loads(path.read_text()))
    except (OSError, ValueError):
        pass
    figures = probe_cpu(hidden, intermediate)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{time.time_ns()}.tmp")
    tmp.write_text(figures.model_dump_json(indent=2))
    tmp.replace(path)
    return figures


def decide_precision(cfg: ExperimentConfig, widths: tuple[int, int] | None = None) -> ResolvedPrecision:
    """The run's precision, decided on the driver before any pool starts.

    widths: the model's (hidden, intermediate) sizes (None: read from the model's config,
    :func:`hybridflow.models.loading.model_widths`, only when a probe is needed). auto on a CPU runs (or reads) the probe; on
    CUDA it asks the driver's GPU for bf16 support (fp32 when the driver sees no GPU). A bf16
    precision forced on a CPU without bf16 instructions warns once with the measured slowdown.
    Raises PrecisionError (fp16-true on a CPU).
    """
    device = run_device_type(cfg)
    requested = cfg.model.precision
    cuda_bf16 = device == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    probe = None
    if device == "cpu" and (requested == "auto" or (requested.startswith("bf16") and not cpu_description()[1])):
        if widths is None:
            from hybridflow.models.loading import model_widths

            widths = model_widths(cfg.model)
        probe = cached_probe(*widths)
    resolved = resolve_precision(requested, device_type=device, cuda_bf16=cuda_bf16, probe=probe)  # type: ignore[arg-type]
    if requested.startswith("bf16") and probe is not None and not probe.cpu_bf16:
        msg = (f"model.precision={requested} on a CPU without bf16 instructions ({cpu_description()[0]}): "
               + (f"the probe measured a training step {1 / probe.layer_speedup:.2f}x slower than fp32"
                  if probe.layer_speedup < 1 else
                  f"the probe measured a training step at {probe.layer_speedup:.2f}x fp32's speed at this width"))
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
        _log.warning(msg)
    return resolved


__all__ = ["cached_probe", "cpu_description", "decide_precision", "machine_key", "probe_cpu", "probe_cache_file"]
