"""Multi-turn rollouts on the hf engine: KV-cache continuation across turns vs prefilling the whole
conversation again every turn (issue 16). Model tokens per second at 2, 3 and 4 assistant turns.

    python -m bench.multi_turn_kv --out bench/results/multi_turn_kv.json

A random Llama (``--hidden``, ``--layers``) with the char tokenizer, ``--rows`` trajectories, turns of
exactly ``--turn-tokens`` tokens (no stop token), an environment that answers every turn with the
same observation (~``--obs-chars`` tokens). Same seed for both modes; the script checks they give
the same tokens. Times include the environment steps (the same in both modes).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


class FixedObservationEnv:
    """Answers every turn with the same text; never done."""

    def __init__(self, chars: int = 48) -> None:
        self.text = ("observation " * 20)[:chars]

    def reset(self, row):
        return None

    def step(self, text: str):
        return self.text, None, False


def run(args: argparse.Namespace) -> dict:
    import torch

    from hybridflow.agents.remote import EnvRunner
    from hybridflow.batch import Batch
    from hybridflow.config import config_from_dict
    from hybridflow.models import build_tiny_model, build_tiny_tokenizer
    from workers.rollout.base import SamplingParams
    from workers.rollout.hf import HFRolloutEngine
    from workers.rollout.multi_turn import MultiTurnRollout

    torch.set_num_threads(args.threads)
    tok = build_tiny_tokenizer()
    model = build_tiny_model(len(tok), hidden_size=args.hidden, layers=args.layers, seed=0).eval()
    chats = [[{"role": "user", "content": f"Question {i}: " + "x" * args.prompt_chars}] for i in range(args.rows)]
    enc = [tok(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
           ["input_ids"] for c in chats]  # fmt: skip
    ids = torch.tensor(enc)
    batch = Batch.from_dict({"prompt_ids": ids, "prompt_mask": torch.ones_like(ids, dtype=torch.bool)},
                            {"raw_chat": chats, "extra_info": [{"env_kwargs": {"chars": args.obs_chars}}] * args.rows})
    runner = EnvRunner(2, 30.0)
    results: dict = {"settings": vars(args), "turns": {}}
    try:
        for turns in args.turns:
            budget = turns * (args.turn_tokens + args.obs_chars + 40)
            row: dict = {}
            outs = {}
            for kv in (False, True):
                cfg = {"environment": "bench.multi_turn_kv:FixedObservationEnv", "max_response_tokens": budget,
                       "multi_turn": {"max_turns": turns, "max_tokens_per_turn": args.turn_tokens, "kv_cache": kv,
                                      "max_observation_tokens": args.obs_chars + 40}}  # fmt: skip
                loop = MultiTurnRollout(HFRolloutEngine(model, tok, generation_batch_trajectories=args.rows), tok,
                                        config_from_dict({"rollout": cfg}).rollout, runner)  # fmt: skip
                sampling = SamplingParams(max_new_tokens=budget, temperature=1.0, n=1, seed=0, stop_token_ids=())
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    outs[kv] = loop.generate(batch, sampling)
                    times.append(time.perf_counter() - start)
                best = min(times)
                model_tokens = int(outs[kv].response_mask.sum())
                row["kv_cache" if kv else "prefill_again"] = {
                    "seconds": round(best, 3), "model_tokens": model_tokens,
                    "tokens_per_s": round(model_tokens / best, 1), "all_seconds": [round(t, 3) for t in times]}
            row["same_tokens"] = bool(torch.equal(outs[True].response_ids, outs[False].response_ids))
            row["speedup"] = round(row["prefill_again"]["seconds"] / row["kv_cache"]["seconds"], 2)
            results["turns"][str(turns)] = row
            print(turns, json.dumps(row))
    finally:
        runner.close()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--turn-tokens", type=int, default=32)
    p.add_argument("--obs-chars", type=int, default=48)
    p.add_argument("--prompt-chars", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    res = run(a)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
