"""Tally tool use in saved multi-turn batches (issue 16): per batch, how many samples call the tool,
how many calls ran cleanly (output without an error / traceback / timeout), how many answers are right.

    python -m bench.agents_tally runs/<run_id>/iter_000000/validate runs/<run_id>/iter_000001 ...

Each argument is a saved batch (path without the .safetensors / .json suffix) holding ``messages``
(the multi-turn rollout's conversations) and ``acc`` (or ``score``) from the reward node — a
``validate`` batch — or a training iteration's folder (its ``rollout`` and ``reward`` batches). A call
is a tool message other than a parse error ("could not parse the tool call: ..."); it "ran cleanly" when
its content has no "Error", "Traceback" or "[timed out" and starts with neither "error" nor "[no output]".
A single-turn batch (no ``messages``) counts only samples and right answers.
"""

from __future__ import annotations

import argparse
import json


def _failed(content: str) -> bool:
    return any(s in content for s in ("Error", "Traceback", "[timed out")) or content.startswith(("error", "[no output]"))


def tally(uri: str) -> dict:
    """{batch, samples, samples_calling_the_tool, tool_calls, tool_calls_clean, accuracy} of one batch."""
    import os

    from hybridflow.batch import Batch

    if os.path.isdir(uri):
        b = Batch.load(os.path.join(uri, "rollout")).union(Batch.load(os.path.join(uri, "reward")))
    else:
        b = Batch.load(uri)
    convs = b["messages"] if "messages" in b else [[] for _ in range(len(b))]
    obs = [[str(m.get("content", "")) for m in conv if m.get("role") == "tool"] for conv in convs]
    tools = [[c for c in conv if not c.startswith("could not parse")] for conv in obs]
    acc_key = "acc" if "acc" in b else "score"
    acc = [float(a) for a in b[acc_key]]
    return {
        "batch": uri,
        "samples": len(b),
        "samples_calling_the_tool": sum(bool(t) for t in tools),
        "tool_calls": sum(len(t) for t in tools),
        "tool_calls_clean": sum(not _failed(c) for t in tools for c in t),
        "parse_errors": sum(len(o) - len(t) for o, t in zip(obs, tools, strict=True)),
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
