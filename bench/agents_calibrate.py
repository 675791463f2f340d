"""Calibrate a tool task before training (issue 16): out of N base-model samples, how many call the
tool, how many of those calls run, how many final answers are right — with the tool and, beside it,
the same prompts without tools (single turn).

    python -m bench.agents_calibrate -c examples/grpo_arith_tool.yaml --data data/arith_tool/test.parquet \
        --prompts 16 --samples 4 --out bench/results/agents_calibration.json

Runs in-process (PolicyWorker, no Ray / Prefect); rollout settings are the config's own.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def _score(rows, use_messages: bool) -> list[float]:
    from hybridflow.rewards.registry import default_compute_score

    out = []
    for i in range(len(rows)):
        if use_messages:
            text = next((m["content"] for m in reversed(rows["messages"][i]) if m["role"] == "assistant"), "")
        else:
            ids, mask = rows["response_ids"][i], rows["response_mask"][i]
            text = _TOK.decode(ids[mask].tolist(), skip_special_tokens=True)
        res = default_compute_score(rows["data_source"][i], text, rows["ground_truth"][i], rows["extra_info"][i])
        out.append(float(res["acc"] if isinstance(res, dict) and "acc" in res else res))
    return out


def run(config: str, data: str, prompts: int, samples: int, overrides: list[str]) -> dict:
    global _TOK
    from hybridflow.config import load_config
    from hybridflow.data import PromptDataset, load_rows
    from workers.policy import PolicyWorker

    ov = [f"data.train_files=[{data}]", f"data.val_files=[{data}]", f"rollout.samples_per_prompt={samples}",
          f"data.prompts_per_iteration={prompts}", f"actor.mini_batch_trajectories={prompts * samples}",
          f"actor.micro_batch_trajectories={samples}", "trainer.device=cpu", *overrides]  # fmt: skip
    result: dict = {"config": config, "data": data, "prompts": prompts, "samples_per_prompt": samples}
    for label, extra in (("with_tool", []), ("without_tools", ["rollout.tools=[]"])):
        cfg = load_config(config, [*ov, *extra])
        worker = PolicyWorker(cfg)
        _TOK = worker.tokenizer
        ds = PromptDataset(load_rows(cfg.data.train_files, cfg.data), worker.tokenizer, cfg.data)
        start = time.perf_counter()
        rows = worker.generate_sequences(ds.collate(list(range(prompts))), seed=0)
        seconds = time.perf_counter() - start
        acc = _score(rows, "messages" in rows)
        m = rows.meta["metrics"]
        n = len(rows)
        entry = {"samples": n, "accuracy": sum(acc) / n, "seconds": round(seconds, 1),
                 "response_length_mean": m["response_length/mean"]}  # fmt: skip
        if "messages" in rows:
            calls = [sum(1 for msg in conv if msg["role"] == "tool" and msg.get("name") != "error")
                     for conv in rows["messages"]]  # fmt: skip
            failed = [sum(1 for msg in conv if msg["role"] == "tool" and msg.get("name") != "error" and (
                          "Error" in msg["content"] or msg["content"].startswith(("error", "[no output]"))))
                      for conv in rows["messages"]]  # fmt: skip
            entry.update({
                "samples_calling_the_tool": sum(c > 0 for c in calls),
                "tool_calls": sum(calls),
                "tool_calls_that_ran_cleanly": sum(calls) - sum(failed),
                "parse_errors": m["tool/parse_errors"], "num_turns_mean": m["multi_turn/num_turns/mean"],
                "example": rows["messages"][0][-4:],
            })  # fmt: skip
            worker._multi_turn.runner.close()
        result[label] = entry
    return result


_TOK = None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-c", "--config", default="examples/grpo_arith_tool.yaml")
    p.add_argument("--data", required=True, help="a parquet/jsonl of the task (e.g. the example's val file)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--out", default=None, help="write the result as JSON here")
    p.add_argument("overrides", nargs="*", help="dotted config overrides")
    a = p.parse_args()
    result = run(a.config, a.data, a.prompts, a.samples, a.overrides)
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
