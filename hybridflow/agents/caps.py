"""Output caps before work: a tool's or an environment's output cut to a byte budget where it is
made (the environment worker process), before it is pickled back, templated, tokenized, stored or
logged (issue 40, defect 3).

The budget comes from ``rollout.multi_turn.max_observation_tokens``: :data:`BYTES_PER_TOKEN` bytes
per token (a token of a byte-level or byte-fallback vocabulary holds at least one byte, and rarely
more than 16), so the token-level cut that follows (:meth:`ChatRenderer.fit_observation`) still
has a head and a tail to keep. The cut keeps the head and the tail around :data:`TRUNCATION_MARKER`,
at UTF-8 character boundaries.
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterator
from typing import Any, TextIO

TRUNCATION_MARKER = "\n...[truncated]...\n"
BYTES_PER_TOKEN = 16


def observation_byte_budget(max_observation_tokens: int) -> int:
    """Bytes an output may keep: ``BYTES_PER_TOKEN * max_observation_tokens`` (256 tokens → 4 KiB)."""
    return BYTES_PER_TOKEN * max_observation_tokens


def cut_middle_bytes(text: str, budget: int, marker: str = TRUNCATION_MARKER) -> str:
    """``text`` if its UTF-8 encoding has ≤ ``budget`` bytes, else its head and tail around ``marker``
    (together ≤ ``budget`` bytes; the tail gets the odd byte), cut at character boundaries (a
    character split by the cut is dropped). Unencodable characters (lone surrogates) count as '?'."""
    data = text.encode("utf-8", "replace")
    if len(data) <= budget:
        return text
    keep = max(0, budget - len(marker.encode("utf-8")))
    head, tail = keep // 2, keep - keep // 2
    return data[:head].decode("utf-8", "ignore") + marker + data[len(data) - tail :].decode("utf-8", "ignore")


def cap_output(output: Any, budget: int) -> tuple[Any, int]:
    """(``output`` with every string cut to ``budget`` bytes, how many strings were cut). ``output``:
    a string, chat messages (each ``content`` string cut), or anything else (returned as it is)."""
    if isinstance(output, str):
        cut = cut_middle_bytes(output, budget)
        return cut, int(cut is not output)
    if isinstance(output, list):
        n, out = 0, []
        for m in output:
            if isinstance(m, dict) and isinstance(m.get("content"), str):
                content = cut_middle_bytes(m["content"], budget)
                n += content is not m["content"]
                m = {**m, "content": content}
            out.append(m)
        return out, n
    return output, 0


class _CappedStream(io.TextIOBase):
    """Forwards the first ``budget`` characters written to ``target``, then one note; drops the rest."""

    def __init__(self, target: TextIO, budget: int) -> None:
        self.target, self.left, self.noted = target, budget, False

    def write(self, text: str) -> int:
        if self.left > 0:
            self.target.write(text[: self.left])
            self.left -= min(len(text), self.left)
        elif text and not self.noted:
            self.noted = True
            self.target.write(f"{TRUNCATION_MARKER.strip()} (the rest of this call's prints are dropped)\n")
        return len(text)

    def flush(self) -> None:
        self.target.flush()


@contextlib.contextmanager
def capped_prints(budget: int) -> Iterator[None]:
    """Within the block, what Python code prints to stdout / stderr reaches the real streams (the
    worker's log) only up to ``budget`` characters each; the rest is dropped after one note."""
    with contextlib.redirect_stdout(_CappedStream(sys.stdout, budget)), \
            contextlib.redirect_stderr(_CappedStream(sys.stderr, budget)):  # fmt: skip
        yield


__all__ = ["capped_prints", "TRUNCATION_MARKER", "BYTES_PER_TOKEN", "observation_byte_budget", "cut_middle_bytes", "cap_output"]
