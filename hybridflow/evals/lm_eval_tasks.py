"""Local lm-eval tasks from verl-format rows: what ``hybridflow data lm-eval-task`` writes.

lm-eval's own tasks read their datasets from the Hugging Face hub, which cannot be reached at
run time here. A local task is a YAML file beside a JSONL file of documents, read with the
``json`` builder of ``datasets`` (no network):

    <out>/<name>.yaml    task: <name>, dataset_path: json, data_files: <abs path of the jsonl>
    <out>/<name>.jsonl   {"question", "system", "answer", "data_source"} per row

``question`` is the row's last user message (lm-eval applies the model's chat template to it
when run with ``apply_chat_template``, which ``hybridflow eval --harness lm-eval`` does by
default), ``system`` the row's system message if any (the harness's ``system_instruction``
cannot vary per document, so rows with a system message are refused: lm-eval would drop it),
``answer`` the row's ``reward_model.ground_truth``.

The answer is extracted the way the prompt asks for it (lm-eval's ``regex`` filter, the last
match): ``\\boxed{...}`` (hybridflow's arith, countdown and GSM8K rows) or
``<answer>...</answer>`` (reasoning-gym rows), and when every answer is a number also as the
response's last number (lm-eval's gsm8k "flexible-extract"); scored by lm-eval's ``exact_match``
(case, commas, ``$`` and a final period ignored). That is exact string match, not the training
reward's math-verify equivalence: ``\\boxed{4.0}`` against ``4`` scores 0 here and 1 in training.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# (what the prompt says, lm-eval regex filter pattern) — the first whose marker is in every prompt wins
ANSWER_FORMATS: dict[str, tuple[str, str]] = {
    "boxed": ("\\boxed{", r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}"),
    "answer_tag": ("<answer>", r"<answer>\s*(.*?)\s*</answer>"),
}


# the last number of a response (lm-eval's gsm8k "flexible-extract": a number of 2+ characters, else a digit)
FLEXIBLE_NUMBER = r"(-?[$0-9.,]{2,})|(-?[0-9]+)"


@dataclass(frozen=True)
class LocalTask:
    """A written task: its name, YAML and JSONL paths, rows written, and the answer format."""

    name: str
    yaml_path: Path
    docs_path: Path
    rows: int
    answer_format: str


def answer_format_of(questions: list[str]) -> str:
    """The :data:`ANSWER_FORMATS` key whose marker every question carries.
    Raises ValueError naming the first question that asks for no known format."""
    for name, (marker, _) in ANSWER_FORMATS.items():
        if all(marker in q for q in questions):
            return name
    for i, q in enumerate(questions):
        if not any(marker in q for marker, _ in ANSWER_FORMATS.values()):
            raise ValueError(f"row {i}: the prompt asks for no answer format lm-eval can extract "
                             f"(\\boxed{{}} or <answer></answer>): {q[:120]!r}")
    raise ValueError("the rows mix answer formats (\\boxed{} and <answer></answer>): write one task per format")


def _document(row: dict[str, Any], i: int) -> dict[str, Any]:
    prompt = row.get("prompt")
    if not isinstance(prompt, list) or not prompt or not isinstance(prompt[-1], dict):
        raise ValueError(f"row {i}: 'prompt' must be a non-empty list of chat messages")
    if prompt[-1].get("role") != "user":
        raise ValueError(f"row {i}: the last prompt message must be the user's, got role {prompt[-1].get('role')!r}")
    if len(prompt) > 1:
        roles = [m.get("role") for m in prompt]
        raise ValueError(f"row {i}: prompt roles {roles}: a local lm-eval task holds single-turn user prompts "
                         "(lm-eval's system_instruction is one for the whole run)")
    truth = (row.get("reward_model") or {}).get("ground_truth")
    if truth is None or isinstance(truth, (dict, list)):
        raise ValueError(f"row {i}: reward_model.ground_truth must be a string or number for exact match, got {truth!r}")
    return {"question": str(prompt[-1]["content"]), "answer": str(truth).strip(),
            "data_source": str(row.get("data_source", ""))}


def is_number(text: str) -> bool:
    try:
        float(text.replace(",", ""))
    except ValueError:
        return False
    return True


def task_config(name: str, docs_path: Path, answer_format: str, max_gen_toks: int, numeric: bool = False) -> dict[str, Any]:
    """The lm-eval task YAML (as a dict) for ``docs_path``: generate_until, greedy, stop at EOS
    only (lm-eval's default stop, a blank line, would cut a chain of thought), the answer
    extracted by :data:`ANSWER_FORMATS` ``[answer_format]`` (metric ``exact_match_<format>``) and,
    when every answer is a number (``numeric``), also as the response's last number (metric
    ``exact_match_flexible``: lm-eval's gsm8k "flexible-extract" filter), exact_match with commas,
    dollar signs and a final period ignored."""
    pattern = ANSWER_FORMATS[answer_format][1]
    filters = [{"name": answer_format, "filter": [
        {"function": "regex", "regex_pattern": pattern, "group_select": -1, "fallback": "[no answer]"},
        {"function": "take_first"}]}]
    if numeric:
        filters.append({"name": "flexible", "filter": [
            {"function": "regex", "regex_pattern": FLEXIBLE_NUMBER, "group_select": -1, "fallback": "[no answer]"},
            {"function": "take_first"}]})
    return {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(docs_path.resolve())}},
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": "{{question}}",
        "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": [], "max_gen_toks": max_gen_toks, "do_sample": False, "temperature": 0.0},
        "filter_list": filters,
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                         "ignore_case": True, "ignore_punctuation": False, "regexes_to_ignore": [",", r"\$", r"\.$"]}],
        "metadata": {"version": 1.0, "source": "hybridflow data lm-eval-task"},
    }


def write_local_task(rows: list[dict[str, Any]], name: str, out_dir: str | Path, *, max_gen_toks: int = 256) -> LocalTask:
    """Write ``<out_dir>/<name>.yaml`` and ``<out_dir>/<name>.jsonl`` from verl rows (see the
    module docstring). Raises ValueError for a bad name, no rows, a row that is not a single
    user turn or has no scalar ground truth, or prompts that ask for no extractable answer."""
    if not name or not all(c.isalnum() or c in "_-" for c in name):
        raise ValueError(f"task name {name!r}: use letters, digits, '_' and '-' only")
    if not rows:
        raise ValueError("no rows to write")
    if max_gen_toks < 1:
        raise ValueError(f"max_gen_toks must be >= 1, got {max_gen_toks}")
    docs = [_document(r, i) for i, r in enumerate(rows)]
    fmt = answer_format_of([d["question"] for d in docs])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    docs_path, yaml_path = out / f"{name}.jsonl", out / f"{name}.yaml"
    docs_path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    numeric = all(is_number(d["answer"]) for d in docs)
    yaml_path.write_text(yaml.safe_dump(task_config(name, docs_path, fmt, max_gen_toks, numeric), sort_keys=False))
    return LocalTask(name, yaml_path, docs_path, len(docs), fmt)
