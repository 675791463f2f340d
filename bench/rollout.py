"""Generation throughput: the ``hf`` rollout engine against a bare transformers ``generate`` loop.

    hybridflow bench rollout [--batches 1,8,64] [--lengths 64,256] [--repeats 3] [--model PATH]
                             [--dtype float32|bfloat16]
    hybridflow bench rollout --engine vllm ...   (vLLM against the hf engine: bench/rollout_vllm.py)
    hybridflow bench rollout --dtypes float32,bfloat16 ...   (the hf engine per dtype: bench/rollout_dtype.py)

Both sides generate from the same left-padded chat prompts with the same model object in one
process, sampling at temperature 1 with no top-k/top-p and no stop token, so every row makes
exactly ``length`` tokens and tokens/s = batch × length / wall seconds (prefill included).
Runs alternate (hf, bare, bare, hf, ...) cell by cell. The engine also returns each token's
log-prob (one log-softmax per step); the bare loop returns tokens only — as TRL's
non-vLLM path does, which then recomputes log-probs with an extra forward pass.

Decode-bound limit: every decode step reads all weights once, so a step takes at least
max(weight bytes / read bandwidth, batch × FLOPs per token / peak GFLOP/s); the limit is
batch / that time. The peak (a float32 ``--probe-size``³ matmul, best of 2) and the read
bandwidth (a sum over ``--bandwidth-mb`` MiB, default 512 as in ``bench peak``, best of 2) are
probed between each cell's runs, so the limit is
the machine's at the time (this box's peak moved from 130 to 196 GFLOP/s between two days);
the limit from bench/results/peak.json is kept in the JSON as ``decode_limit_peak_json_tokens_per_s``.
The limit counts decode FLOPs only while the measured time includes the prompt's prefill.
The engine runs with its defaults (``rollout.fused_decode`` and ``rollout.packed_weights`` on);
the JSON's ``engine`` entry says whether its last call ran fused (and why not, if not).
``--dtype bfloat16``: the hf engine generates in bfloat16 (``rollout.dtype``) on the float32 model;
the bare loop stays float32 (the reference), the peak probe runs in bfloat16 and the limit counts
2-byte weights, so the limit is bfloat16's.
Writes bench/results/rollout.json and the ``rollout`` table of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402


def bare_generate(model, ids, mask, length: int, pad_id: int, seed: int):
    """What a user writes: ``model.generate(do_sample=True)`` at T = 1, no top-k/top-p, no EOS stop."""
    import torch
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    saved, model.generation_config = model.generation_config, GenerationConfig()
    try:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask.long(), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=length, min_new_tokens=0,
                                 pad_token_id=pad_id, eos_token_id=None)
    finally:
        model.generation_config = saved
    return out[:, ids.shape[1]:]


def engine_generate(engine, ids, mask, length: int, seed: int):
    from workers.rollout.base import SamplingParams

    sampling = SamplingParams(max_new_tokens=length, temperature=1.0, top_p=1.0, top_k=-1, stop_token_ids=(),
                              n=1, seed=seed)
    return engine.generate(ids, mask, sampling).response_ids


def decode_limit(model, batch: int, peak: dict | None, param_bytes: int | None = None) -> float | None:
    """Tokens/s upper bound of decoding (see the module docstring); None without peak.json.
    param_bytes: bytes per weight read (None: the parameters' own; 2 for a bfloat16 rollout)."""
    if not peak:
        return None
    weight_bytes = sum(p.numel() * (param_bytes or p.element_size()) for p in model.parameters())
    flops = common.model_flops_per_token(model)["dense"]
    step = max(weight_bytes / (peak["bandwidth"]["read_gbs"] * 1e9), batch * flops / (peak["peak_gflops"] * 1e9))
    return batch / step


def call_limit(model, batch: int, length: int, prompt_len: int, peak: dict | None,
               param_bytes: int | None = None) -> float | None:
    """Tokens/s upper bound of a whole generate call: ``length`` decode steps (each at least
    :func:`decode_limit`'s step time, the first of them fed the prompt's last token) plus the
    prefill of the other ``batch`` × (``prompt_len`` − 1) prompt positions (padding included, as
    computed) at the peak, their FLOPs without the LM head, which the prefill runs on no position.
    The measured tokens/s include the prefill, the decode limit does not; None without ``peak``."""
    if not peak:
        return None
    cfg = model.config
    flops = common.model_flops_per_token(model)["dense"]
    prefill = batch * (prompt_len - 1) * (flops - 2.0 * cfg.vocab_size * cfg.hidden_size) / (peak["peak_gflops"] * 1e9)
    return batch * length / (length * batch / decode_limit(model, batch, peak, param_bytes) + prefill)


def profile_cell(model, engine, prompts, batch: int, length: int, pad_id: int, path: Path) -> None:
    """torch-profile one hf-engine call and one bare call of a cell; top ops of each to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    ids, mask = prompts[0][:batch], prompts[1][:batch]
    parts = []
    for name, fn in (("hf engine", lambda: engine_generate(engine, ids, mask, length, 1)),
                     ("bare generate", lambda: bare_generate(model, ids, mask, length, pad_id, 1))):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        parts.append(f"## {name}, batch {batch} × {length} tokens\n"
                     + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    path.write_text("\n\n".join(parts))
    print(f"profile written to {path}")


def run_cell(model, engine, prompts, batch: int, length: int, repeats: int, pad_id: int,
             probe_size: int = 2048, bandwidth_mb: int = 512, dtype: str = "float32") -> dict:
    ids, mask = prompts[0][:batch], prompts[1][:batch]
    counter = {"seed": 0}

    def side(fn):
        def call():
            counter["seed"] += 1
            seconds, out = common.timed(lambda: fn(counter["seed"]))
            if tuple(out.shape) != (batch, length):
                raise RuntimeError(f"expected {batch}×{length} generated tokens, got {tuple(out.shape)}")
            return batch * length / seconds

        return call

    from bench.peak import bandwidth, square_gflops

    runs = {
        "hf": side(lambda s: engine_generate(engine, ids, mask, length, s)),
        "bare": side(lambda s: bare_generate(model, ids, mask, length, pad_id, s)),
        "peak_probe": lambda: square_gflops(probe_size, dtype=dtype),
        "read_gbs_probe": lambda: bandwidth(bandwidth_mb, 2)["read_gbs"],
    }
    got = common.alternate(runs, repeats, warmup=False)
    ratios = [h / b for h, b in zip(got["hf"], got["bare"], strict=True)]
    probed = {"peak_gflops": common.stats(got["peak_probe"])["median"],
              "bandwidth": {"read_gbs": common.stats(got["read_gbs_probe"])["median"]}}
    return {"batch": batch, "length": length, "prompt_len": int(ids.shape[1]),
            "hf_tokens_per_s": got["hf"], "bare_tokens_per_s": got["bare"],
            "hf": common.stats(got["hf"]), "bare": common.stats(got["bare"]), "ratio": common.stats(ratios),
            "peak_alongside_gflops": common.stats(got["peak_probe"]),
            "read_gbs_alongside": common.stats(got["read_gbs_probe"]),
            "decode_limit_tokens_per_s": decode_limit(model, batch, probed, _BYTES[dtype]),
            "call_limit_tokens_per_s": call_limit(model, batch, length, int(ids.shape[1]), probed, _BYTES[dtype]),
            "probe_size": probe_size, "bandwidth_mb": bandwidth_mb}


def measure(model_path: str, batches: list[int], lengths: list[int], repeats: int,
            max_cell_tokens: int | None = None, profile: str | None = None, probe_size: int = 2048,
            bandwidth_mb: int = 512, dtype: str = "float32") -> dict:
    from bench.peak import load_peak
    from workers.rollout.hf import HFRolloutEngine

    model, tok = common.load_model(model_path)
    engine = HFRolloutEngine(model, tok, generation_batch_trajectories=max(batches), dtype=dtype)
    prompts = common.prompt_batch(tok, max(batches))
    pad = int(tok.pad_token_id)
    engine_generate(engine, prompts[0][:2], prompts[1][:2], 4, 0)  # warm-up (allocations, kernels)
    bare_generate(model, prompts[0][:2], prompts[1][:2], 4, pad, 0)
    peak = load_peak()
    cells, skipped = [], []
    for b in batches:
        for n in lengths:
            if max_cell_tokens and b * n > max_cell_tokens:
                skipped.append([b, n])
                continue
            cell = run_cell(model, engine, prompts, b, n, repeats, pad, probe_size, bandwidth_mb, dtype)
            cell["decode_limit_peak_json_tokens_per_s"] = decode_limit(model, b, peak)
            cells.append(cell)
            print(f"batch {b:3d} × {n:4d} tokens: hf {cell['hf']['median']:.1f} tok/s, bare "
                  f"{cell['bare']['median']:.1f} tok/s, ratio {cell['ratio']['median']:.3f}", flush=True)
    if profile:
        b, n = (int(x) for x in profile.split("x"))
        profile_cell(model, engine, prompts, b, n, pad, common.RESULTS_DIR / "rollout_profile.txt")
    return {"model": model_path, "repeats": repeats, "dtype": dtype, "cells": cells, "skipped_cells": skipped,
            "engine": {"fused_decode": engine.fused_decode_reason is None, "fused_decode_reason": engine.fused_decode_reason,
                       "packed_linears": engine.packed_linears},
            "peak_used": None if not peak else {"peak_gflops": peak["peak_gflops"],
                                                "read_gbs": peak["bandwidth"]["read_gbs"]}}


def render(res: dict) -> str:
    rows = []
    for c in res["cells"]:
        lim, call = c.get("decode_limit_tokens_per_s"), c.get("call_limit_tokens_per_s")
        rows.append((c["batch"], c["length"], f"{c['hf']['median']:.1f}", f"{c['bare']['median']:.1f}",
                     f"{c['ratio']['median']:.3f} ({c['ratio']['min']:.3f}–{c['ratio']['max']:.3f})",
                     "—" if lim is None else f"{lim:.0f}",
                     "—" if lim is None else f"{100 * c['hf']['median'] / lim:.0f}%",
                     "—" if call is None else f"{100 * c['hf']['median'] / call:.0f}%"))
    probed = any("peak_alongside_gflops" in c for c in res["cells"])  # older results: the limit of peak.json
    table = common.markdown_table(
        ["batch", "new tokens", "hf engine tok/s", "bare generate tok/s", "hf / bare, median (min–max)",
         f"decode limit tok/s ({'probed alongside' if probed else 'peak.json'})", "hf / limit",
         "hf / limit with the prompt's prefill"], rows)
    skipped = res.get("skipped_cells") or []
    note = f" Skipped for CPU time: {', '.join(f'{b}×{n}' for b, n in skipped)}." if skipped else ""
    eng = res.get("engine")
    path = ""
    if eng:
        path = (" The hf engine decoded through the fused step (`rollout.fused_decode`)." if eng["fused_decode"]
                else f" The hf engine decoded through the model's forward ({eng['fused_decode_reason']}).")
    return "\n\n".join([
        common.measured_under(res["environment"]) + f" Model `{res['model']}`, {res['repeats']} alternating "
        "runs per cell; tokens/s are medians; hf engine in " + res.get("dtype", "float32") + ", bare generate in "
        "float32." + path + note,
        table,
    ])


_BYTES = {"float32": 4, "bfloat16": 2}  # bytes per weight the engine reads, by --dtype


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    engine = argparse.ArgumentParser(add_help=False)
    engine.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    known, rest = engine.parse_known_args(argv)
    if known.engine == "vllm":  # vLLM against the hf engine, in the vLLM runtime (bench/rollout_vllm.py)
        from bench import rollout_vllm

        return rollout_vllm.main(rest)
    if any(x == "--dtypes" or x.startswith("--dtypes=") for x in rest):  # hf engine per dtype (bench/rollout_dtype.py)
        from bench import rollout_dtype

        return rollout_dtype.main(rest)
    argv = rest
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf",
                   help="hf: the hf engine against bare generate (this); vllm: vLLM against the hf engine")
    p.add_argument("--model", default=common.DEMO_MODEL, help="model.path (default: the demo model)")
    p.add_argument("--batches", type=_ints, default=[1, 8, 64], help="comma-separated batch sizes")
    p.add_argument("--lengths", type=_ints, default=[64, 256], help="comma-separated response lengths")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-cell-tokens", type=int, default=None,
                   help="skip cells with batch × length above this (CPU time); they are listed as skipped")
    p.add_argument("--profile", metavar="BxN", default=None,
                   help="torch-profile one call of each side at batch B × N tokens (bench/results/rollout_profile.txt)")
    p.add_argument("--dtype", choices=sorted(_BYTES), default="float32",
                   help="the hf engine's rollout.dtype (the model stays float32; so does bare generate)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--probe-size", type=int, default=2048,
                   help="size of the square matmul peak probe run between each cell's runs")
    p.add_argument("--bandwidth-mb", type=int, default=512,
                   help="MiB read by the bandwidth probe run between each cell's runs")
    p.add_argument("--out", default=None)
    p.add_argument("--no-docs", action="store_true")
    args = p.parse_args(argv)
    common.set_threads(args.threads)
    res = common.write_result_and_render("rollout", measure(args.model, args.batches, args.lengths, args.repeats,
                                                              args.max_cell_tokens, args.profile, args.probe_size,
                                                              args.bandwidth_mb, args.dtype),
                                         render, out=args.out, docs=not args.no_docs)
    return 0 if res else 1


if __name__ == "__main__":
    raise SystemExit(main())
