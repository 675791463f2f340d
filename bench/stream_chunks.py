"""What partial rollouts cost: the streaming generator (``trainer.async_mode: stream``,
workers/group_stream.py) at several ``rollout.partial_chunk_tokens`` against whole responses, with
no weight change, on the hf engine.

    hybridflow bench stream_chunks [--model smollm2-135m-instruct] [--groups 4] [--samples 8]
                                   [--tokens 48] [--chunks 8,16,32] [--repeats 3]

Each setting generates the same ``--groups`` prompt groups × ``--samples`` samples of up to
``--tokens`` tokens (arithmetic chat prompts as the demo's, temperature 0.7, the tokenizer's stop
ids) through a :class:`~workers.group_stream.GroupStreamer` in completion order, one engine call
per chunk for every unfinished row of the wave; "whole" is one chunk of ``--tokens`` (what
``rollout.partial: off`` does). Settings alternate within each repeat (A B C, C B A, ...) after
one untimed round. Reported per setting: median / min / max wall seconds until every group
finished, engine calls, prompt + prefix tokens prefilled (each chunk after the first prefills the
prompt and the prefix again: the cost of aborting and resubmitting), tokens generated, and the
ratio of wall seconds to "whole". Weights never change here, so the extra time is the re-prefill
alone; in a training run a chunk boundary is also where newer weights may land. Each chunk size
also runs "interruptible" (what the training's rollout worker does on the hf engine, capability
``partial_rollout_interrupt``): one call per response, asked at every chunk boundary whether newer
weights arrived (here never), so it should cost what "whole" costs.
Writes bench/results/stream_chunks.json and the ``stream_chunks`` table of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402


def run_once(engine: Any, tok: Any, prompts: list[list[int]], samples: int, tokens: int, chunk: int,
             seed: int, interruptible: bool = False) -> dict[str, float]:
    """Generate every prompt's group with chunks of ``chunk`` tokens (``interruptible``: calls cut
    only where newer weights arrive, never here); the wall seconds and the streamer's counters."""
    from hybridflow.models import tokenizer_stop_ids
    from workers.group_stream import GroupStreamer
    from workers.rollout.base import SamplingParams

    sampling = SamplingParams(max_new_tokens=tokens, temperature=0.7, stop_token_ids=tuple(tokenizer_stop_ids(tok)),
                              n=samples, seed=seed)
    st = GroupStreamer(engine, sampling, pad_id=int(tok.pad_token_id), chunk_tokens=chunk,
                       batch_rows=len(prompts) * samples, order="completion", group_size_iter=len(prompts),
                       max_staleness=1, load_newest=lambda: 0, load_version=lambda v: True, version=lambda: 0,
                       lock=threading.Lock(), newer_weights=(lambda: False) if interruptible else None)
    t0 = time.perf_counter()
    st.start()
    try:
        st.sync([{"gid": g, "prompt": p, "seed": seed + g} for g, p in enumerate(prompts)])
        while len(st.finished()) < len(prompts):
            time.sleep(0.005)
        wall = time.perf_counter() - t0
    finally:
        st.stop()
    s = st.take_stats()
    return {"wall_s": wall, "calls": s["calls"], "prefill_tokens": s["prefill_tokens"], "tokens": s["tokens"]}


def measure(model_path: str, groups: int, samples: int, tokens: int, chunks: list[int], repeats: int) -> dict[str, Any]:
    from workers.rollout.hf import HFRolloutEngine

    model, tok = common.load_model(model_path)
    ids, mask = common.prompt_batch(tok, groups, seed=0)
    prompts = [ids[i][mask[i]].tolist() for i in range(groups)]
    engine = HFRolloutEngine(model, tok, generation_batch_trajectories=groups * samples)
    settings = {f"chunk {c}": (c, False) for c in chunks if c < tokens}
    settings.update({f"chunk {c}, interruptible": (c, True) for c in chunks if c < tokens})
    settings["whole"] = (tokens, False)
    rounds = {"n": 0}

    def side(chunk: int, interruptible: bool):
        def run() -> dict[str, float]:
            rounds["n"] += 1
            return run_once(engine, tok, prompts, samples, tokens, chunk, seed=1000 + rounds["n"] // len(settings),
                            interruptible=interruptible)
        return run

    out = common.alternate({name: side(*c) for name, c in settings.items()}, repeats)
    whole = common.stats([r["wall_s"] for r in out["whole"]])["median"]
    rows = {}
    for name, runs in out.items():
        wall = common.stats([r["wall_s"] for r in runs])
        rows[name] = {"chunk_tokens": settings[name][0], "interruptible": settings[name][1], "wall_s": wall,
                      "calls": common.stats([r["calls"] for r in runs])["median"],
                      "prefill_tokens": common.stats([r["prefill_tokens"] for r in runs])["median"],
                      "tokens": common.stats([r["tokens"] for r in runs])["median"],
                      "wall_ratio_to_whole": wall["median"] / whole if whole > 0 else None, "runs": runs}
    return {"model": model_path, "groups": groups, "samples": samples, "max_tokens": tokens, "repeats": repeats,
            "settings": rows}


def render(res: dict[str, Any]) -> str:
    head = (common.measured_under(res["environment"]) + f" Model `{res['model']}`, {res['groups']} groups × "
            f"{res['samples']} samples, up to {res['max_tokens']} tokens, hf engine (fused decode), no weight change; "
            f"medians of {res['repeats']} alternated repeats after one untimed round.")
    rows = []
    for name, r in res["settings"].items():
        w = r["wall_s"]
        rows.append((name, f"{w['median']:.2f}", f"{w['min']:.2f}–{w['max']:.2f}", f"{r['calls']:.0f}",
                     f"{r['prefill_tokens']:.0f}", f"{r['tokens']:.0f}", f"{r['wall_ratio_to_whole']:.2f}"))
    table = common.markdown_table(["setting", "wall s (median)", "min–max", "engine calls", "tokens prefilled",
                                   "tokens generated", "÷ whole"], rows)
    return head + "\n\n" + table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=common.DEMO_MODEL)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--chunks", default="8,16,32", help="comma list of partial_chunk_tokens settings")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--no-docs", action="store_true")
    args = p.parse_args(argv)
    try:
        chunks = [int(c) for c in args.chunks.split(",") if c.strip()]
    except ValueError:
        p.error(f"--chunks takes a comma list of integers, got {args.chunks!r}")
    if any(c < 1 for c in chunks) or args.repeats < 1 or args.tokens < 1:
        p.error("--chunks, --tokens and --repeats must be ≥ 1")
    common.exit_cleanly_on_sigterm()
    res = measure(args.model, args.groups, args.samples, args.tokens, chunks, args.repeats)
    common.write_result_and_render("stream_chunks", res, render, out=args.out, docs=not args.no_docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
