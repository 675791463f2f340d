"""This machine's measured limits: float32 matmul GFLOP/s at the demo model's shapes, and memory
bandwidth — the denominators of MFU and of the decode-bound generation limit.

    hybridflow bench peak [--tokens 2048] [--repeats 5] [--bandwidth-mb 512] [--threads N]

Matmuls: [tokens, in] @ [in, out] for every distinct weight shape of SmolLM2-135M (hidden 576,
MLP 1536, 3 KV heads × 64, vocab 49152), plus a square ``--square``³ reference (2048). Per shape the best of
``--repeats`` timed calls after a warm-up (the best, not the median: a peak is what the
hardware can do when nothing else runs). ``model_mix_gflops`` is the FLOP-weighted harmonic
mean over one token's matmuls (what a perfect forward pass would reach); ``peak_gflops`` the
fastest shape. Bandwidth: ``sum`` of a ``--bandwidth-mb`` float32 tensor (read) and
``copy_`` into another (read + write), best of the repeats.
Writes bench/results/peak.json and the ``peak`` table of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

# (name, in, out, count per layer or per model) of SmolLM2-135M: 30 layers
SMOLLM2_SHAPES = [
    ("q_proj / o_proj", 576, 576, 2 * 30),
    ("k_proj / v_proj", 576, 192, 2 * 30),
    ("gate / up", 576, 1536, 2 * 30),
    ("down", 1536, 576, 30),
    ("lm_head", 576, 49152, 1),
]


def best_seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_rows(tokens: int, repeats: int, shapes=SMOLLM2_SHAPES, square: int = 2048) -> list[dict]:
    import torch

    rows = []
    g = torch.Generator().manual_seed(0)
    squares = [(f"square {square}³", square, square, 0)] if square else []
    for name, k, n, count in [*shapes, *squares]:
        m = square if name.startswith("square") else tokens
        a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
        out = torch.empty(m, n)
        s = best_seconds(lambda a=a, b=b, out=out: torch.mm(a, b, out=out), repeats)
        flops = 2.0 * m * k * n
        rows.append({"shape": name, "m": m, "k": k, "n": n, "count": count, "seconds": s, "gflops": flops / s / 1e9})
    return rows


def square_gflops(size: int = 2048, repeats: int = 2, dtype: str = "float32") -> float:
    """Best GFLOP/s of a size³ matmul in ``dtype`` ("float32" | "bfloat16"): the peak probe other
    benchmarks interleave with their runs."""
    if dtype == "float32":
        return matmul_rows(size, repeats, shapes=[], square=size)[0]["gflops"]
    import torch

    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=g).to(getattr(torch, dtype)) for _ in range(2))
    out = torch.empty(size, size, dtype=a.dtype)
    return 2.0 * size**3 / best_seconds(lambda: torch.mm(a, b, out=out), repeats) / 1e9


def model_mix(rows: list[dict]) -> float:
    """FLOP-weighted harmonic mean GFLOP/s over the model's matmuls (time = Σ flops_i / rate_i)."""
    flops = [2.0 * r["m"] * r["k"] * r["n"] * r["count"] for r in rows if r["count"]]
    secs = [f / (r["gflops"] * 1e9) for f, r in zip(flops, [r for r in rows if r["count"]], strict=True)]
    return sum(flops) / sum(secs) / 1e9


def bandwidth(mb: int, repeats: int) -> dict[str, float]:
    import torch

    n = mb * (1 << 20) // 4
    src, dst = torch.ones(n), torch.empty(n)
    read = best_seconds(lambda: src.sum(), repeats)
    copy = best_seconds(lambda: dst.copy_(src), repeats)
    nbytes = n * 4
    return {"bytes": nbytes, "read_gbs": nbytes / read / 1e9, "copy_gbs": 2 * nbytes / copy / 1e9}


def measure(tokens: int = 2048, repeats: int = 5, bandwidth_mb: int = 512, square: int = 2048) -> dict:
    rows = matmul_rows(tokens, repeats, square=square)
    return {
        "tokens": tokens,
        "repeats": repeats,
        "matmul": rows,
        "peak_gflops": max(r["gflops"] for r in rows),
        "model_mix_gflops": model_mix(rows),
        "bandwidth": bandwidth(bandwidth_mb, repeats),
    }


def load_peak(path: str | Path | None = None) -> dict | None:
    """The last peak.json (None when never measured)."""
    import json

    p = Path(path) if path else common.RESULTS_DIR / "peak.json"
    return json.loads(p.read_text()) if p.exists() else None


def render(res: dict) -> str:
    rows = [(r["shape"], f"{r['m']}×{r['k']} @ {r['k']}×{r['n']}", f"{1e3 * r['seconds']:.2f}", f"{r['gflops']:.1f}")
            for r in res["matmul"]]
    bw = res["bandwidth"]
    return "\n\n".join([
        common.measured_under(res["environment"]),
        common.markdown_table(["matmul (float32)", "shape", "best ms", "GFLOP/s"], rows),
        f"Peak (fastest shape): **{res['peak_gflops']:.1f} GFLOP/s**; the model's FLOP mix at {res['tokens']} "
        f"tokens: **{res['model_mix_gflops']:.1f} GFLOP/s**. Memory bandwidth ({bw['bytes'] >> 20} MiB): read "
        f"**{bw['read_gbs']:.1f} GB/s**, copy (read + write) {bw['copy_gbs']:.1f} GB/s.",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048, help="rows of the activation matrix (micro-batch 8 × 256)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bandwidth-mb", type=int, default=512)
    p.add_argument("--square", type=int, default=2048, help="size of the square reference matmul")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="JSON path (default bench/results/peak.json)")
    p.add_argument("--no-docs", action="store_true", help="do not touch docs/benchmarks.md")
    args = p.parse_args(argv)
    common.set_threads(args.threads)
    common.write_result_and_render("peak", measure(args.tokens, args.repeats, args.bandwidth_mb, args.square), render,
                                   out=args.out, docs=not args.no_docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
