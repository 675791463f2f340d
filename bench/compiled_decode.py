"""The compiled decode step (``rollout.compile``) against the eager decode loop.

    hybridflow bench compiled_decode [--cells 4x8x48,2x8x128] [--repeats 3] [--model PATH]

A cell PxSxT is P chat-templated arithmetic prompts (the demo's task) × S samples at
temperature 1, up to T new tokens, EOS stop, one decode chunk of P·S rows — as in
``bench finished_rows``. Both sides are the hf engine's own loop (finished rows leave the
batch) on the same model object and seeds; one compiles each decode step on a static KV cache
(``workers/rollout/compiled.py``), the other runs it eagerly. The compiled side's first call
(its warm-up) compiles every (batch bucket, length bucket) shape it meets: its wall seconds and
the compile seconds are reported apart from the timed runs, which alternate with the eager side.
Decode work is counted as in ``bench finished_rows`` (rows fed summed over steps): the compiled
side also computes finished rows that still sit in a batch bucket. A greedy run per cell checks that both sides pick the same tokens; for the sampled runs the share
of identical rows and the largest log-prob gap on them are reported.
Writes bench/results/compiled_decode.json and the ``compiled_decode`` table of docs/benchmarks.md.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402


def run_cell(model, tok, prompts: int, samples: int, tokens: int, repeats: int) -> dict:
    from workers.rollout.base import SamplingParams
    from workers.rollout.hf import HFRolloutEngine

    ids, mask = common.prompt_batch(tok, prompts)
    rows = prompts * samples
    engines = {"eager": HFRolloutEngine(model, tok, generation_batch_trajectories=rows),
               "compiled": HFRolloutEngine(model, tok, generation_batch_trajectories=rows, compile=True)}  # fmt: skip
    stop = (int(tok.eos_token_id),)

    def sampling(seed: int, greedy: bool = False) -> SamplingParams:
        return SamplingParams(max_new_tokens=tokens, temperature=0.0 if greedy else 1.0, n=samples, seed=seed,
                              stop_token_ids=stop)  # fmt: skip

    start = time.perf_counter()
    first = engines["compiled"].generate(ids, mask, sampling(0))
    first_call = time.perf_counter() - start
    compile_stats = dict(engines["compiled"].compile_stats)
    greedy = {k: e.generate(ids, mask, sampling(0, greedy=True)) for k, e in engines.items()}
    seed = {"eager": 0, "compiled": 0}
    outputs: dict[str, list] = {"eager": [], "compiled": []}

    work = {"eager": {"row_steps": 0, "useful_row_steps": 0}, "compiled": {"row_steps": 0, "useful_row_steps": 0}}

    def side(name: str):
        def call():
            seed[name] += 1
            outputs[name].append(engines[name].generate(ids, mask, sampling(seed[name])))
            for k, v in engines[name].decode_stats.items():
                work[name][k] += v

        return call

    got = common.alternate({"eager": side("eager"), "compiled": side("compiled")}, repeats, warmup=False)
    return {"prompts": prompts, "samples": samples, "max_tokens": tokens, "prompt_len": int(ids.shape[1]),
            "seconds": got, "eager": common.stats(got["eager"]), "compiled": common.stats(got["compiled"]),
            "speedup": common.stats([e / c for e, c in zip(got["eager"], got["compiled"], strict=True)]),
            "first_call_seconds": first_call, "first_call_rows": len(first.response_ids),
            "compiles": compile_stats["compiles"], "compile_seconds": compile_stats["compile_seconds"],
            "compiles_after_timed_runs": engines["compiled"].compile_stats["compiles"], "work": work,
            **common.identical_outputs((greedy["eager"], greedy["compiled"]), outputs["eager"], outputs["compiled"])}


def measure(model_path: str, cells: list[tuple[int, int, int]], repeats: int) -> dict:
    return common.measure_cells(model_path, cells, repeats, run_cell, lambda cell: (
        f"eager {cell['eager']['median']:.2f} s, compiled {cell['compiled']['median']:.2f} s, "
        f"×{cell['speedup']['median']:.2f}; {cell['compiles']} shapes compiled in {cell['compile_seconds']:.0f} s; "
        f"greedy identical {cell['greedy_identical_rows']}"))


def render(res: dict) -> str:
    rows = []
    for c in res["cells"]:
        rows.append((f"{c['prompts']} × {c['samples']}", c["max_tokens"], f"{c['eager']['median']:.2f}",
                     f"{c['compiled']['median']:.2f}", f"{c['work']['eager']['row_steps']} / {c['work']['compiled']['row_steps']}",
                     f"{c['speedup']['median']:.2f} ({c['speedup']['min']:.2f}–{c['speedup']['max']:.2f})",
                     f"{c['compiles']} in {c['compile_seconds']:.0f} s", f"{c['compiles_after_timed_runs'] - c['compiles']}",
                     f"{c['greedy_identical_rows'][0]} / {c['greedy_identical_rows'][1]} ({c['greedy_max_log_prob_gap']:.1e})",
                     f"{c['identical_rows'][0]} / {c['identical_rows'][1]} ({c['max_log_prob_gap_identical_rows']:.1e})"))
    table = common.markdown_table(
        ["prompts × samples", "max tokens", "eager s", "compiled s", "row-steps eager / compiled", "eager ÷ compiled, median (min–max)",
         "shapes compiled (first call)", "shapes compiled later", "greedy identical rows (max Δ log-prob)",
         "sampled identical rows (max Δ log-prob)"], rows)
    return "\n\n".join([
        common.measured_under(res["environment"]) + f" Model `{res['model']}`, temperature 1, EOS stop, "
        f"{res['repeats']} alternating runs per side after the compiled side's first (compiling) call; seconds "
        "are medians.",
        table,
    ])


def main(argv: list[str] | None = None) -> int:
    return common.cells_main("compiled_decode", __doc__, "4x8x48,2x8x128", measure, render, argv)


if __name__ == "__main__":
    raise SystemExit(main())
