"""Decoding on oneDNN-packed weights (``rollout.packed_weights``) against plain ``F.linear``.

    hybridflow bench packed_weights [--cells 4x8x48,2x8x128,8x4x256] [--repeats 3] [--model PATH]

A cell PxSxT is P chat-templated arithmetic prompts (the demo's task) × S samples at
temperature 1, up to T new tokens, EOS stop, one decode chunk of P·S rows — as in
``bench finished_rows``. Both sides are the hf engine's own loop on the same model object and
seeds, with ``rollout.fused_decode`` off; one packs every linear weight once per generate call
(``workers/rollout/packed_weights.py``, the packing included in its time), the other runs
``F.linear``. Timed runs alternate
(unpacked, packed, packed, unpacked, ...) after a warm-up. A greedy run per cell counts the rows
whose tokens are identical on both sides; for the sampled runs, the share of identical rows and
the largest log-prob gap on them (float rounding moves a sampled token only where its uniform
falls at a CDF boundary).
Writes bench/results/packed_weights.json and the ``packed_weights`` table of docs/benchmarks.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

SIDES = ("unpacked", "packed")


def run_cell(model, tok, prompts: int, samples: int, tokens: int, repeats: int) -> dict:
    sides = {"unpacked": {"packed_weights": False, "fused_decode": False},
             "packed": {"packed_weights": True, "fused_decode": False}}
    cell, engines = common.engine_pair_cell(model, tok, prompts, samples, tokens, repeats, sides)
    return {**cell, "packed_linears": engines["packed"].packed_linears}


def measure(model_path: str, cells: list[tuple[int, int, int]], repeats: int) -> dict:
    return common.measure_cells(model_path, cells, repeats, run_cell,
                                lambda cell: common.engine_pair_line(cell, "unpacked", "packed"))


def render(res: dict) -> str:
    return common.engine_pair_table(res, "unpacked", "packed", ('unpacked', 'packed'),
                                    "the packing (once per generate call) included")


def main(argv: list[str] | None = None) -> int:
    return common.cells_main("packed_weights", __doc__, "4x8x48,2x8x128,8x4x256", measure, render, argv)


if __name__ == "__main__":
    raise SystemExit(main())
