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
    return common.measure_cells(model_path, cells, repeats, run_cell,
                                lambda cell: common.engine_pair_line(cell, "forward", "fused"))


def render(res: dict) -> str:
    return common.engine_pair_table(res, "forward", "fused", ('forward (packed)', 'fused'),
                                    "each side's weight preparation (once per generate call) included")


def main(argv: list[str] | None = None) -> int:
    return common.cells_main("fused_decode", __doc__, "4x8x48,2x8x128,8x4x256", measure, render, argv)


if __name__ == "__main__":
    raise SystemExit(main())
