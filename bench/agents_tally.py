"""Tally tool use in saved multi-turn batches (issue 16): per batch, how many samples call the tool,
how many calls ran cleanly (output without an error / traceback / timeout), how many answers are right.

    python -m bench.agents_tally runs/<run_id>/iter_000000/validate runs/<run_id>/iter_000001/reward ...

Each argument is a saved batch (path without the .safetensors / .json suffix) holding ``messages``
(the multi-turn rollout's conversations) and ``acc`` (or ``score``) from the reward node: a
``validate`` batch, or an iteration's ``reward`` batch. A call is a tool message; it "ran cleanly"
when its content has no "Error", "Traceback", "error:" prefix, "[no output]" or "[timed out".
"""

from __future__ import annotations

import argparse
import json


def _failed(content: str) -> bool:
    return any(s in content for s in ("Error", "Traceback", "[timed out")) or content.startswith(
        ("error", "[no output]", "could not parse"))  # fmt: skip


def tally(uri: str) -> dict:
    """{batch, samples, samples_calling_the_tool, tool_calls, tool_calls_clean, accuracy} of one batch."""
    from hybridflow.batch import Batch

    b = Batch.load(uri)
    tools = [[m for m in conv if m.get("role") == "tool"] for conv in b["messages"]]
    acc_key = "acc" if "acc" in b else "score"
    acc = [float(a) for a in b[acc_key]]
    return {
        "batch": uri,
        "samples": len(b),
        "samples_calling_the_tool": sum(bool(t) for t in tools),
        "tool_calls": sum(len(t) for t in tools),
        "tool_calls_clean": sum(not _failed(str(m.get("content", ""))) for t in tools for m in t),
        "accuracy": sum(acc) / max(1, len(acc)),
        "right": int(sum(a >= 1.0 for a in acc)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("batches", nargs="+", help="saved batches (path without suffix)")
    for uri in p.parse_args().batches:
        print(json.dumps(tally(uri)))


if __name__ == "__main__":
    main()
