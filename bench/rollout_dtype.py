"""Generation throughput of the hf engine in bfloat16 against float32, each with its compute limit:
``hybridflow bench rollout --dtypes float32,bfloat16`` (or ``hybridflow bench rollout_dtype``).

    hybridflow bench rollout --dtypes float32,bfloat16 [--batches 8,32,64] [--lengths 64,256] [--repeats 3]

One float32 model and one hf engine per ``rollout.dtype`` on it (fused decode, packed weights:
the engine's defaults; the bfloat16 engine packs bfloat16 copies of the weights and keeps its KV
cache in bfloat16) generate from the same left-padded chat prompts, alternating within each cell
(A B, B A, ...), temperature 1, no top-k/top-p, no stop token: every row makes exactly ``length``
tokens and tokens/s = batch × length / wall seconds (prefill included). Between the runs a
``--probe-size``³ matmul in each dtype (best of 2) and a ``--bandwidth-mb`` MiB read are probed,
so each dtype's limit is the machine's at the time: the decode limit
(:func:`bench.rollout.decode_limit`: max(weight bytes / read bandwidth, batch × 2N / peak), with
that dtype's bytes per weight and matmul peak) and the call limit with the prompt's prefill
(:func:`bench.rollout.call_limit`). The ratio is the second dtype's tokens/s ÷ the first's, per
run pair. Writes bench/results/rollout_dtype.json and the ``rollout_dtype`` table of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from bench.rollout import _BYTES, call_limit, decode_limit, engine_generate  # noqa: E402


def run_cell(model, engines: dict, prompts, batch: int, length: int, repeats: int, probe_size: int = 2048,
             bandwidth_mb: int = 512) -> dict:
    """One (batch, length) cell: every engine alternately, with both peaks and the bandwidth probed."""
    from bench.peak import bandwidth, square_gflops

    ids, mask = prompts[0][:batch], prompts[1][:batch]
    seed = {"n": 0}

    def side(engine):
        def call() -> float:
            seed["n"] += 1
            seconds, out = common.timed(lambda: engine_generate(engine, ids, mask, length, seed["n"]))
            if tuple(out.shape) != (batch, length):
                raise RuntimeError(f"expected {batch}×{length} generated tokens, got {tuple(out.shape)}")
            return batch * length / seconds
        return call

    runs = {d: side(e) for d, e in engines.items()}
    runs |= {f"peak_{d}": (lambda d=d: square_gflops(probe_size, dtype=d)) for d in engines}
    runs["read_gbs"] = lambda: bandwidth(bandwidth_mb, 2)["read_gbs"]
    got = common.alternate(runs, repeats, warmup=False)
    read = common.stats(got["read_gbs"])
    first, *others = list(engines)
    cell = {"batch": batch, "length": length, "prompt_len": int(ids.shape[1]), "read_gbs_alongside": read,
            "dtypes": {}, "ratios": {}}
    for d in engines:
        peak = common.stats(got[f"peak_{d}"])
        probed = {"peak_gflops": peak["median"], "bandwidth": {"read_gbs": read["median"]}}
        cell["dtypes"][d] = {"tokens_per_s": got[d], **common.stats(got[d]), "peak_alongside_gflops": peak,
                             "decode_limit_tokens_per_s": decode_limit(model, batch, probed, _BYTES[d]),
                             "call_limit_tokens_per_s": call_limit(model, batch, length, int(ids.shape[1]), probed,
                                                                   _BYTES[d])}
    for d in others:
        cell["ratios"][f"{d}/{first}"] = common.stats([b / a for a, b in zip(got[first], got[d], strict=True)])
    return cell


def measure(model_path: str, batches: list[int], lengths: list[int], repeats: int, dtypes: list[str],
            probe_size: int = 2048, bandwidth_mb: int = 512) -> dict:
    from workers.rollout.hf import HFRolloutEngine

    model, tok = common.load_model(model_path)
    engines = {d: HFRolloutEngine(model, tok, generation_batch_trajectories=max(batches), dtype=d) for d in dtypes}
    prompts = common.prompt_batch(tok, max(batches))
    for engine in engines.values():
        engine_generate(engine, prompts[0][:2], prompts[1][:2], 4, 0)  # warm-up (packing, allocations, kernels)
    cells = []
    for b in batches:
        for n in lengths:
            cell = run_cell(model, engines, prompts, b, n, repeats, probe_size, bandwidth_mb)
            cells.append(cell)
            print(f"batch {b:3d} × {n:4d} tokens: " + ", ".join(
                f"{d} {v['median']:.1f} tok/s" for d, v in cell["dtypes"].items()) + "; " + ", ".join(
                f"{k} {v['median']:.2f}" for k, v in cell["ratios"].items()), flush=True)
    return {"model": model_path, "repeats": repeats, "dtypes": dtypes, "cells": cells,
            "engines": {d: {"fused_decode": e.fused_decode_reason is None, "fused_decode_reason": e.fused_decode_reason,
                            "packed_linears": e.packed_linears} for d, e in engines.items()},
            "probe_size": probe_size, "bandwidth_mb": bandwidth_mb}


def render(res: dict) -> str:
    first, *others = res["dtypes"]
    rows = []
    for c in res["cells"]:
        row = [c["batch"], c["length"]]
        for d in res["dtypes"]:
            v = c["dtypes"][d]
            lim, call = v["decode_limit_tokens_per_s"], v["call_limit_tokens_per_s"]
            row += [f"{v['median']:.1f}", f"{lim:.0f} ({100 * v['median'] / lim:.0f} %)",
                    f"{100 * v['median'] / call:.0f} %"]
        for d in others:
            r = c["ratios"][f"{d}/{first}"]
            row.append(f"{r['median']:.2f} ({r['min']:.2f}–{r['max']:.2f})")
        row.append(" / ".join(f"{c['dtypes'][d]['peak_alongside_gflops']['median']:.0f}" for d in res["dtypes"])
                   + f"; {c['read_gbs_alongside']['median']:.1f} GB/s")
        rows.append(row)
    header = ["batch", "new tokens"]
    for d in res["dtypes"]:
        header += [f"{d} tok/s", f"{d} decode limit tok/s (% reached)", f"{d} % of limit with prefill"]
    header += [f"{d} ÷ {first}, median (min–max)" for d in others]
    header.append(f"matmul peak GFLOP/s {' / '.join(res['dtypes'])}; read bandwidth")
    fused = ", ".join(f"{d}: {'fused' if e['fused_decode'] else e['fused_decode_reason']}"
                      for d, e in res["engines"].items())
    return "\n\n".join([
        common.measured_under(res["environment"]) + f" CPU bf16 flags: {', '.join(res.get('bf16_flags', [])) or 'none'}."
        f" Model `{res['model']}` (float32 weights), one hf engine per rollout.dtype ({fused}), {res['repeats']} "
        "alternating runs per cell; tokens/s are medians; limits from the peaks and bandwidth probed between the runs.",
        common.markdown_table(header, rows),
    ])


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    from hybridflow.precision_probe import cpu_description

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=common.DEMO_MODEL)
    p.add_argument("--batches", type=lambda t: [int(x) for x in _csv(t)], default=[8, 32, 64])
    p.add_argument("--lengths", type=lambda t: [int(x) for x in _csv(t)], default=[64])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtypes", type=_csv, default=["float32", "bfloat16"],
                   help="rollout.dtype of each engine; ratios are against the first")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--probe-size", type=int, default=2048)
    p.add_argument("--bandwidth-mb", type=int, default=512)
    p.add_argument("--out", default=None)
    p.add_argument("--no-docs", action="store_true")
    args = p.parse_args(argv)
    bad = [d for d in args.dtypes if d not in _BYTES]
    if bad or len(args.dtypes) < 2:
        p.error(f"--dtypes takes two or more of {sorted(_BYTES)}, got {args.dtypes}")
    common.set_threads(args.threads)
    data = measure(args.model, args.batches, args.lengths, args.repeats, args.dtypes, args.probe_size,
                   args.bandwidth_mb)
    data["bf16_flags"] = list(cpu_description()[1])
    common.write_result_and_render("rollout_dtype", data, render, out=args.out, docs=not args.no_docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
