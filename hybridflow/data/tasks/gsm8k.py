"""GSM8K (Cobbe et al. 2021) from the public jsonl (``question`` / ``answer`` with a final
``#### N`` line) to verl-format rows (data_source "openai/gsm8k"), as verl's
``examples/data_preprocess/gsm8k.py`` does: same instruction, ground truth = the number after
``####`` with thousands separators removed.
"""

from __future__ import annotations

import json
import re
from typing import Any

import fsspec

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_FINAL = re.compile(r"####\s*(.+?)\s*$")


def gsm8k_rows(jsonl_path: str, *, split: str = "train") -> list[dict[str, Any]]:
    """Rows from a GSM8K jsonl file (any fsspec path).

    Raises ValueError naming the line when a line is not JSON, lacks question/answer, or its
    answer has no ``#### N`` line with a number.
    """
    rows = []
    with fsspec.open(jsonl_path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                question, answer = rec["question"], rec["answer"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{jsonl_path}: line {lineno}: not a GSM8K record ({e!r})") from None
            truth = _final_answer(answer)
            if truth is None:
                raise ValueError(f"{jsonl_path}: line {lineno}: answer has no '#### N' line with a number")
            index = len(rows)
            rows.append({
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": truth},
                "extra_info": {"split": split, "index": index, "question": question, "answer": answer},
            })  # fmt: skip
    return rows


def _final_answer(answer: str) -> str | None:
    lines = [ln for ln in str(answer).splitlines() if "####" in ln]
    match = _FINAL.search(lines[-1]) if lines else None
    if match is None:
        return None
    value = match.group(1).replace(",", "").replace("$", "").strip()
    return value if re.fullmatch(r"-?\d+(\.\d+)?", value) else None
