"""The trainer's forward layout (``actor.pack_rows``): rows packed without padding against padded
rows (with each distinct prompt computed once where prompts repeat), on real rollouts.

    hybridflow bench pack_rows [--cells 4x8x48,2x8x128,8x4x256,16x1x128] [--repeats 3] [--model PATH]

A cell PxSxT is one rollout of the demo's kind (P chat-templated arithmetic prompts × S samples at
temperature 1, up to T new tokens, EOS stop; the hf engine, seed 0), so the response lengths are
the ones training meets. Its batch (old_log_probs from ``compute_log_probs``, random advantages)
is then updated by three ``PolicyWorker``s loaded alike, with ``actor.pack_rows`` = off, on and
auto (mini-batch 16, micro-batch 8, one epoch), alternating; each update is timed
(``timing_s/update_actor``) and the token positions its forwards computed are counted (the
``input_ids`` sizes seen by the decoder). 16 × 1 is PPO's shape: no prompt repeats, so ``off``
runs padded rows. Writes bench/results/pack_rows.json and the ``pack_rows`` table of
docs/benchmarks.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

SIDES = ("off", "on", "auto")
MINI, MICRO = 16, 8


def rollout_batch(model, tok, prompts: int, samples: int, tokens: int):
    """One rollout's batch: prompts repeated per sample, responses, masks, position ids."""
    import torch

    from hybridflow.algorithms import position_ids_from_mask
    from hybridflow.batch import Batch
    from workers.rollout.base import SamplingParams
    from workers.rollout.hf import HFRolloutEngine

    ids, mask = common.prompt_batch(tok, prompts)
    engine = HFRolloutEngine(model, tok, generation_batch_trajectories=prompts * samples)
    with torch.no_grad():
        out = engine.generate(ids, mask, SamplingParams(max_new_tokens=tokens, temperature=1.0, n=samples, seed=0,
                                                        stop_token_ids=(int(tok.eos_token_id),)))
    p_ids, p_mask = ids.repeat_interleave(samples, 0), mask.bool().repeat_interleave(samples, 0)
    attn = torch.cat([p_mask, out.response_mask], 1)
    rows = len(p_ids)
    return Batch.from_dict({"prompt_ids": p_ids, "prompt_mask": p_mask, "response_ids": out.response_ids,
                            "response_mask": out.response_mask, "position_ids": position_ids_from_mask(attn)},
                           {"uid": [str(i // samples) for i in range(rows)]})


def run_cell(model, tok, prompts: int, samples: int, tokens: int, repeats: int, model_path: str) -> dict:
    import torch

    from bench.train import train_config
    from workers.policy import PolicyWorker

    batch = rollout_batch(model, tok, prompts, samples, tokens)
    rows = len(batch)
    workers, positions = {}, {}
    for side in SIDES:
        cfg = train_config(model_path, MICRO, 8, 1, **{"actor.pack_rows": side, "data.prompts_per_iteration": prompts,
                                                       "rollout.samples_per_prompt": samples,
                                                       "rollout.max_response_tokens": tokens,
                                                       "actor.mini_batch_trajectories": min(MINI, rows),
                                                       "actor.micro_batch_trajectories": min(MICRO, rows)})
        w = PolicyWorker(cfg)
        positions[side] = []
        w.module.model.register_forward_pre_hook(
            lambda m, a, kw, s=side: positions[s].append(kw["input_ids"].numel()), with_kwargs=True)
        workers[side] = w
    g = torch.Generator().manual_seed(0)
    batch = workers["off"].compute_log_probs(batch)
    batch.set("advantages", torch.randn(batch["response_mask"].shape, generator=g))
    version = dict.fromkeys(SIDES, 0)
    counted: dict[str, int] = {}

    def side(name: str):
        def call():
            positions[name].clear()
            m = workers[name].update_policy(batch, expected_version=version[name], batch_id=f"b{version[name]}")
            version[name] += 1
            counted[name] = sum(positions[name])
            return m["timing_s/update_actor"]

        return call

    got = common.alternate({s: side(s) for s in SIDES}, repeats)
    lengths = batch["response_mask"].sum(1).float()
    return {"prompts": prompts, "samples": samples, "max_tokens": tokens, "prompt_len": int(batch["prompt_ids"].shape[1]),
            "rows": rows, "real_tokens": int(batch["prompt_mask"].sum() + batch["response_mask"].sum()),
            "seconds": got, **{s: common.stats(got[s]) for s in SIDES}, "positions": counted,
            "off_over_on": common.stats([a / b for a, b in zip(got["off"], got["on"], strict=True)]),
            "off_over_auto": common.stats([a / b for a, b in zip(got["off"], got["auto"], strict=True)]),
            "response_length": {"mean": float(lengths.mean()), "min": int(lengths.min()), "max": int(lengths.max())}}


def measure(model_path: str, cells: list[tuple[int, int, int]], repeats: int) -> dict:
    model, tok = common.load_model(model_path)
    out = []
    for p, s, t in cells:
        cell = run_cell(model, tok, p, s, t, repeats, model_path)
        out.append(cell)
        print(f"{p}×{s}, ≤{t} tokens: " + ", ".join(f"{k} {cell[k]['median']:.2f} s ({cell['positions'][k]} positions)"
                                                  for k in SIDES), flush=True)
    return {"model": model_path, "repeats": repeats, "mini_batch": MINI, "micro_batch": MICRO, "cells": out}


def render(res: dict) -> str:
    rows = []
    for c in res["cells"]:
        rl, pos = c["response_length"], c["positions"]
        rows.append((f"{c['prompts']} × {c['samples']}", c["max_tokens"], f"{rl['mean']:.1f} ({rl['min']}–{rl['max']})",
                     c["real_tokens"], f"{pos['off']} / {pos['on']} / {pos['auto']}",
                     f"{c['off']['median']:.2f} / {c['on']['median']:.2f} / {c['auto']['median']:.2f}",
                     f"{c['off_over_on']['median']:.2f} ({c['off_over_on']['min']:.2f}–{c['off_over_on']['max']:.2f})",
                     f"{c['off_over_auto']['median']:.2f} ({c['off_over_auto']['min']:.2f}–{c['off_over_auto']['max']:.2f})"))
    table = common.markdown_table(
        ["prompts × samples", "max tokens", "response length mean (min–max)", "real tokens",
         "positions computed off / on / auto", "update s off / on / auto", "off ÷ on, median (min–max)",
         "off ÷ auto, median (min–max)"], rows)
    return "\n\n".join([
        common.measured_under(res["environment"]) + f" Model `{res['model']}`; one rollout per cell (temperature 1, "
        f"EOS stop, seed 0), then `update_policy` on it with mini-batch {res['mini_batch']}, micro-batch "
        f"{res['micro_batch']}, by three workers (`actor.pack_rows` off / on / auto), {res['repeats']} alternating "
        "runs each after a warm-up; seconds are medians. Positions: the token positions the update's forwards "
        "computed (real tokens = prompt + response tokens of the batch).",
        table,
    ])


def main(argv: list[str] | None = None) -> int:
    return common.cells_main("pack_rows", __doc__, "4x8x48,2x8x128,8x4x256,16x1x128", measure, render, argv)


if __name__ == "__main__":
    raise SystemExit(main())
