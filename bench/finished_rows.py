"""Decode work spent on finished rows: the hf engine's own loop (rows leave the batch as they
finish) against transformers' ``generate`` (every row computed until the longest finishes).

    hybridflow bench finished_rows [--cells 4x8x48,2x8x128,8x4x256] [--repeats 3] [--model PATH]

A cell PxSxT is P chat-templated arithmetic prompts (the demo's task, built as the train flow
builds them) × S samples each at temperature 1, up to T new tokens, stopping at the tokenizer's
EOS — a GRPO rollout of the demo's kind. Both sides run on the same model object, same seeds,
alternating (own, generate, generate, own, ...); the share of rows with identical tokens on both
sides is reported. Reported per cell: wall seconds (median, min–max), the ratio generate ÷ own, and the
decode work: rows fed summed over steps (``row_steps``) against Σ response lengths; the share
of row-steps spent on rows already finished is 1 − Σ lengths ÷ row_steps.
Writes bench/results/finished_rows.json and the ``finished_rows`` table of docs/benchmarks.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402


def run_cell(model, tok, prompts: int, samples: int, tokens: int, repeats: int) -> dict:
    import torch

    from workers.rollout.base import SamplingParams
    from workers.rollout.hf import HFRolloutEngine

    ids, mask = common.prompt_batch(tok, prompts)
    engines = {"own": HFRolloutEngine(model, tok, generation_batch_trajectories=prompts * samples),
               "generate": HFRolloutEngine(model, tok, generation_batch_trajectories=prompts * samples,
                                           drop_finished_rows=False)}  # fmt: skip
    seed = {"own": 0, "generate": 0}
    outputs: dict[str, list] = {"own": [], "generate": []}
    work: dict[str, dict] = {}

    def side(name: str):
        def call():
            seed[name] += 1
            sampling = SamplingParams(max_new_tokens=tokens, temperature=1.0, n=samples, seed=seed[name],
                                      stop_token_ids=(int(tok.eos_token_id),))  # fmt: skip
            out = engines[name].generate(ids, mask, sampling)
            outputs[name].append(out)
            work.setdefault(name, {"row_steps": 0, "useful_row_steps": 0})
            for k, v in engines[name].decode_stats.items():
                work[name][k] += v
            return None

        return call

    got = common.alternate({"own": side("own"), "generate": side("generate")}, repeats)
    # same seed, same uniforms: the paths differ only in float rounding (a row's batch changes as
    # rows leave), which flips a sampled token only where a uniform falls at a CDF boundary
    same = sum(int((a.response_ids == b.response_ids).all(-1).sum()) for a, b in zip(outputs["own"], outputs["generate"], strict=True))
    total = sum(len(a.response_ids) for a in outputs["own"])
    lp_gap = max((float((a.rollout_log_probs - b.rollout_log_probs).abs()[(a.response_ids == b.response_ids).all(-1)].max())
                  for a, b in zip(outputs["own"], outputs["generate"], strict=True)
                  if (a.response_ids == b.response_ids).all(-1).any()), default=0.0)  # fmt: skip
    ratios = [g / o for o, g in zip(got["own"], got["generate"], strict=True)]
    lengths = torch.cat([o.response_mask.sum(-1) for o in outputs["own"]]).float()
    return {"prompts": prompts, "samples": samples, "max_tokens": tokens, "prompt_len": int(ids.shape[1]),
            "seconds": got, "own": common.stats(got["own"]), "generate": common.stats(got["generate"]),
            "speedup": common.stats(ratios), "work": work, "identical_rows": [same, total],
            "max_log_prob_gap_identical_rows": lp_gap,
            "finished_share": {k: 1 - w["useful_row_steps"] / max(w["row_steps"], 1) for k, w in work.items()},
            "response_length": {"mean": float(lengths.mean()), "min": int(lengths.min()), "max": int(lengths.max())}}


def measure(model_path: str, cells: list[tuple[int, int, int]], repeats: int) -> dict:
    return common.measure_cells(model_path, cells, repeats, run_cell, lambda cell: (
        f"own {cell['own']['median']:.2f} s, generate {cell['generate']['median']:.2f} s, "
        f"×{cell['speedup']['median']:.2f}; finished-row share {cell['finished_share']['generate']:.0%} → "
        f"{cell['finished_share']['own']:.0%}"))


def render(res: dict) -> str:
    rows = []
    for c in res["cells"]:
        rl, w = c["response_length"], c["work"]
        rows.append((f"{c['prompts']} × {c['samples']}", c["max_tokens"], f"{rl['mean']:.1f} ({rl['min']}–{rl['max']})",
                     f"{c['generate']['median']:.2f}", f"{c['own']['median']:.2f}",
                     f"{c['speedup']['median']:.2f} ({c['speedup']['min']:.2f}–{c['speedup']['max']:.2f})",
                     f"{w['generate']['row_steps']} / {w['own']['row_steps']}",
                     f"{c['finished_share']['generate']:.0%} → {c['finished_share']['own']:.0%}",
                     f"{c['identical_rows'][0]} / {c['identical_rows'][1]}",
                     f"{c['max_log_prob_gap_identical_rows']:.1e}"))
    table = common.markdown_table(
        ["prompts × samples", "max tokens", "response length mean (min–max)", "generate s", "own loop s",
         "generate ÷ own, median (min–max)", "row-steps generate / own", "row-steps on finished rows",
         "rows with identical tokens", "max Δ log-prob there"], rows)
    return "\n\n".join([
        common.measured_under(res["environment"]) + f" Model `{res['model']}`, temperature 1, EOS stop, "
        f"{res['repeats']} alternating runs per side after a warm-up; seconds are medians. Both sides draw from "
        "the same seeds; a row's tokens differ only where float rounding (its batch changes as rows leave) moves "
        "a sampled token across a CDF boundary.",
        table,
    ])


def main(argv: list[str] | None = None) -> int:
    return common.cells_main("finished_rows", __doc__, "4x8x48,2x8x128,8x4x256", measure, render, argv)


if __name__ == "__main__":
    raise SystemExit(main())
