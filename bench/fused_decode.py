"""The fused CPU decode step (``rollout.fused_decode``) against decoding through the model's forward.

    hybridflow bench fused_decode [--cells 4x8x48,2x8x128,8x4x256] [--repeats 3] [--model PATH]

A cell PxSxT is P chat-templated arithmetic prompts (the demo's task) × S samples at
temperature 1, up to T new tokens, EOS stop, one decode chunk of P·S rows — as in
``bench packed_weights``. Both sides are the hf engine's own loop (finished rows leave) on the
same model object and seeds: the baseline runs the model's forward on oneDNN-packed linears
(``rollout.packed_weights``, the default before fused decoding), the other prefills and decodes
through ``workers/rollout/fused_decode.py`` (its weight preparation, once per generate call,
included in its time). Timed runs alternate after a warm-up. A greedy run per cell counts the
rows whose tokens are identical on both sides; for the sampled runs, the share of identical rows
and the largest log-prob gap on them.
Writes bench/results/fused_decode.json and the ``fused_decode`` table of docs/benchmarks.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

SIDES = {"forward": {"packed_weights": True, "fused_decode": False}, "fused": {"fused_decode": True}}


def run_cell(model, tok, prompts: int, samples: int, tokens: int, repeats: int) -> dict:
    cell, engines = common.engine_pair_cell(model, tok, prompts, samples, tokens, repeats, SIDES)
    reason = engines["fused"].fused_decode_reason
    if reason is not None:
        raise RuntimeError(f"the fused side did not run fused: {reason}")
    return cell


def measure(model_path: str, cells: list[tuple[int, int, int]], repeats: int) -> dict:
    return common.measure_cells(model_path, cells, repeats, run_cell, lambda cell: (
        f"forward {cell['forward']['median']:.2f} s, fused {cell['fused']['median']:.2f} s, "
        f"×{cell['speedup']['median']:.2f} ({cell['speedup']['min']:.2f}–{cell['speedup']['max']:.2f}); "
        f"greedy identical {cell['greedy_identical_rows']}"))


def render(res: dict) -> str:
    rows = []
    for c in res["cells"]:
        rows.append((f"{c['prompts']} × {c['samples']}", c["max_tokens"], f"{c['forward']['median']:.2f}",
                     f"{c['fused']['median']:.2f}",
                     f"{c['speedup']['median']:.2f} ({c['speedup']['min']:.2f}–{c['speedup']['max']:.2f})",
                     f"{c['response_tokens']['forward']} / {c['response_tokens']['fused']}",
                     f"{c['greedy_identical_rows'][0]} / {c['greedy_identical_rows'][1]} ({c['greedy_max_log_prob_gap']:.1e})",
                     f"{c['identical_rows'][0]} / {c['identical_rows'][1]} ({c['max_log_prob_gap_identical_rows']:.1e})"))
    table = common.markdown_table(
        ["prompts × samples", "max tokens", "forward (packed) s", "fused s", "forward ÷ fused, median (min–max)",
         "response tokens forward / fused", "greedy identical rows (max Δ log-prob)",
         "sampled identical rows (max Δ log-prob)"], rows)
    return "\n\n".join([
        common.measured_under(res["environment"]) + f" Model `{res['model']}`, temperature 1, EOS stop, "
        f"{res['repeats']} alternating runs per side after a warm-up; seconds are medians, each side's weight "
        "preparation (once per generate call) included.",
        table,
    ])


def main(argv: list[str] | None = None) -> int:
    return common.cells_main("fused_decode", __doc__, "4x8x48,2x8x128,8x4x256", measure, render, argv)


if __name__ == "__main__":
    raise SystemExit(main())
