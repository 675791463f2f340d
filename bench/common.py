"""What the benchmarks share: environment capture, alternating timed runs, result files,
the markdown sections of docs/benchmarks.md, the demo model and its prompts.

Benchmarks are measurements, never tests: nothing here asserts a speed. Every result
records the machine's load average, because on a shared 2-core box the load moves every
number; compare ratios from one alternating run, not absolute times across runs.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # scripts run as files (python bench/x.py) import the repo's packages
    sys.path.insert(0, str(ROOT))

RESULTS_DIR = ROOT / "bench" / "results"
DOCS_PATH = ROOT / "docs" / "benchmarks.md"
DEMO_MODEL = "smollm2-135m-instruct"


# ---- environment ---------------------------------------------------------------------------------


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
    """Machine facts every result carries: CPU, cores, torch version and threads, load average."""
    import torch

    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "allocator": allocator(),
    }


def allocator() -> str:
    """``keep-freed`` when this process started with the pools' glibc malloc settings
    (``workers.allocator.KEEP_FREED_MEMORY_ENV``, what ``hybridflow bench`` sets by default),
    else ``default``. glibc reads them only at start, so this reads the environment the process
    started with (``/proc/self/environ``; ``os.environ`` where there is none), not later changes."""
    from workers.allocator import KEEP_FREED_MEMORY_ENV

    try:
        raw = Path("/proc/self/environ").read_bytes().decode(errors="replace")
        start = dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)
    except OSError:
        start = dict(os.environ)
    kept = all(start.get(k) == v for k, v in KEEP_FREED_MEMORY_ENV.items())
    return "keep-freed" if kept else "default"


def exit_cleanly_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so ``finally`` blocks stop the Prefect server and Ray we started."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def set_threads(threads: int | None) -> int:
    """Set torch intra-op threads (None: leave torch's choice). Returns the count in force."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


# ---- timing --------------------------------------------------------------------------------------


def stats(values: Sequence[float]) -> dict[str, float]:
    """{min, median, max, n} of a non-empty sequence."""
    if not values:
        raise ValueError("stats of no values")
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call, wall clock."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def alternate(runs: dict[str, Callable[[], Any]], repeats: int, *, warmup: bool = True) -> dict[str, list[Any]]:
    """Call each of ``runs`` ``repeats`` times, interleaved A B, B A, A B, ... so that drift in
    the machine's load hits every side alike. Each callable returns its measurement (or None to
    be timed here: the wall seconds are recorded). ``warmup``: one untimed call of each first.
    Returns {name: [measurement per repeat]}."""
    names = list(runs)
    if warmup:
        for name in names:
            runs[name]()
    out: dict[str, list[Any]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            seconds, value = timed(runs[name])
            out[name].append(seconds if value is None else value)
    return out


# ---- results -------------------------------------------------------------------------------------


def write_result(name: str, data: dict[str, Any], out: str | Path | None = None) -> Path:
    """Write ``data`` plus the environment to ``bench/results/<name>.json`` (or ``out``)."""
    path = Path(out) if out else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": name, "environment": environment(), **data}, indent=2))
    return path


def write_result_and_render(name: str, data: dict[str, Any], render: Callable[[dict[str, Any]], str], *,
                            out: str | Path | None = None, docs: bool = True) -> dict[str, Any]:
    """Write the JSON result, print its markdown, and put it into docs/benchmarks.md (``docs``).
    Returns the result as written (with its ``environment``)."""
    path = write_result(name, data, out)
    res = json.loads(path.read_text())
    text = render(res)
    print(text)
    if docs:
        update_docs_section(name, text)
    print(f"\nwritten to {path}")
    return res


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A GitHub markdown table; floats formatted by the caller. ``align``: one of 'l'/'r' per column."""
    align = align or "l" + "r" * (len(header) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(sep) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def update_docs_section(name: str, body: str, docs: str | Path | None = None) -> Path:
    """Replace the generated block of ``name`` in docs/benchmarks.md (between
    ``<!-- bench:NAME:begin -->`` and ``<!-- bench:NAME:end -->``), appending a new section
    when the markers are absent. Text outside the markers (the analysis) is left alone."""
    path = Path(docs) if docs else DOCS_PATH
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    begin, end = f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip() + f"\n\n## {name}\n\n{block}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def measured_under(env: dict[str, Any]) -> str:
    """One line saying where and under what load a result was measured."""
    load = env["load_avg"]
    return (f"Measured {env['date']} on {env['cpu']} ({env['cores']} cores), torch {env['torch']} with "
            f"{env['torch_threads']} threads; load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 min)"
            + (f"; glibc malloc: {env['allocator']}." if env.get("allocator") else "."))


# ---- model and prompts ---------------------------------------------------------------------------


def load_model(path: str = DEMO_MODEL, *, seed: int = 0, tiny_hidden: int = 32, tiny_layers: int = 2):
    """(model in eval mode, tokenizer) of ``model.path`` in float32 on CPU, dropout off."""
    from hybridflow.config import ModelConfig
    from hybridflow.models import load_causal_lm, load_tokenizer
    from workers.micro_batches import disable_dropout

    cfg = ModelConfig(path=path, tiny_hidden_size=tiny_hidden, tiny_layers=tiny_layers)
    model = disable_dropout(load_causal_lm(cfg, seed=seed)).eval()
    return model, load_tokenizer(cfg)


def arith_rows(n: int, *, seed: int = 0, difficulty: int = 1) -> list[dict[str, Any]]:
    """``n`` verl-format arithmetic rows (chat prompt, ground truth)."""
    from hybridflow.data.tasks import make_arith

    return make_arith(n, difficulty=difficulty, seed=seed)


def write_arith_file(path: str | Path, n: int, *, seed: int = 0) -> str:
    """Write ``n`` arithmetic rows as a verl-format parquet/jsonl file (by suffix); returns the path."""
    from hybridflow.data import write_rows

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_rows(arith_rows(n, seed=seed), str(path))
    return str(path)


def prompt_dataset(tokenizer: Any, n: int, *, seed: int = 0, workdir: str | Path | None = None):
    """hybridflow's PromptDataset of ``n`` chat-templated arithmetic prompts."""
    import tempfile

    from hybridflow.config import DataConfig
    from hybridflow.data import PromptDataset, load_rows

    with tempfile.TemporaryDirectory(dir=workdir) as d:
        cfg = DataConfig()
        rows = load_rows([write_arith_file(Path(d) / "prompts.jsonl", n, seed=seed)], cfg)
        return PromptDataset(rows, tokenizer, cfg)


def prompt_batch(tokenizer: Any, n: int, *, seed: int = 0):
    """(prompt_ids [n, P] int64 left padded, prompt_mask [n, P] bool) of ``n`` chat-templated
    arithmetic prompts, built exactly as the train flow builds them."""
    batch = prompt_dataset(tokenizer, n, seed=seed).collate(list(range(n)))
    return batch["prompt_ids"], batch["prompt_mask"]


def model_flops_per_token(model: Any) -> dict[str, float]:
    """Matmul FLOPs of one token's forward pass, by the 2·N rule plus attention scores.

    N counts every matrix a token multiplies (the LM head included even when tied to the
    embedding; the embedding lookup itself is free; norm vectors are not matmuls). Returns {"dense": 2·N,
    "attn_per_ctx": FLOPs per token per context position (QKᵀ and AV: 4·layers·heads·head_dim)}.
    Training is 3× the forward (backward = 2× forward), the PaLM/Chinchilla convention.
    """
    cfg = model.config
    embed = cfg.vocab_size * cfg.hidden_size
    n = sum(p.numel() for p in model.parameters() if p.dim() == 2)  # matmul weights; norms are elementwise
    if not getattr(cfg, "tie_word_embeddings", False):
        n -= embed  # the input embedding is a lookup; the separate lm_head stays counted
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {"dense": 2.0 * n, "attn_per_ctx": 4.0 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim}


# ---- rollout cell benchmarks (bench finished_rows, bench compiled_decode) ----------------------


def parse_cells(text: str) -> list[tuple[int, int, int]]:
    """"4x8x48,2x8x128" → [(prompts, samples, max tokens), ...]. Raises ValueError naming the
    cell that is not three positive integers joined by x."""
    cells = []
    for c in (c.strip() for c in text.split(",")):
        if not c:
            continue
        parts = c.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"cell {c!r}: expected PROMPTSxSAMPLESxTOKENS, three positive integers (e.g. 4x8x48)")
        cells.append((int(parts[0]), int(parts[1]), int(parts[2])))
    if not cells:
        raise ValueError(f"--cells {text!r} names no cell")
    return cells


def same_rows(a: Any, b: Any) -> tuple[int, int, float]:
    """Two RolloutOutputs of the same rows: (rows with identical tokens, rows, max |Δ log-prob| on
    those rows); (0, rows, 0.0) when the response widths differ."""
    rows = (a.response_ids == b.response_ids).all(-1) if a.response_ids.shape == b.response_ids.shape else None
    if rows is None:
        return 0, len(a.response_ids), 0.0
    gap = float((a.rollout_log_probs - b.rollout_log_probs).abs()[rows].max()) if rows.any() else 0.0
    return int(rows.sum()), len(rows), gap


def identical_outputs(greedy: tuple[Any, Any], sampled_a: Sequence[Any], sampled_b: Sequence[Any]) -> dict[str, Any]:
    """How alike two rollout paths came out: ``greedy`` one RolloutOutput per path, ``sampled_a`` /
    ``sampled_b`` the paths' sampled outputs run by run (same seeds). Returns the
    ``greedy_identical_rows`` [same, rows], ``greedy_max_log_prob_gap``, ``identical_rows``
    [same, rows] and ``max_log_prob_gap_identical_rows`` entries of a cell (:func:`same_rows`)."""
    g_same, g_rows, g_gap = same_rows(*greedy)
    same = [same_rows(a, b) for a, b in zip(sampled_a, sampled_b, strict=True)]
    return {"greedy_identical_rows": [g_same, g_rows], "greedy_max_log_prob_gap": g_gap,
            "identical_rows": [sum(s[0] for s in same), sum(s[1] for s in same)],
            "max_log_prob_gap_identical_rows": max((s[2] for s in same), default=0.0)}


def engine_pair_cell(model: Any, tok: Any, prompts: int, samples: int, tokens: int, repeats: int,
                     sides: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One rollout cell (``prompts`` chat prompts × ``samples`` at temperature 1, ≤ ``tokens``, EOS
    stop, one decode chunk) on two hf engines over the same model object and seeds, built from
    ``sides`` {name: HFRolloutEngine kwargs} (two entries, the baseline first). Timed runs
    alternate after a warm-up; a greedy run per side compares tokens. Returns (the cell: seconds
    per side, their stats, ``speedup`` = baseline ÷ other per round, response tokens, and
    :func:`identical_outputs`; the engines by name)."""
    from workers.rollout.base import SamplingParams
    from workers.rollout.hf import HFRolloutEngine

    ids, mask = prompt_batch(tok, prompts)
    rows = prompts * samples
    engines = {k: HFRolloutEngine(model, tok, generation_batch_trajectories=rows, **kw) for k, kw in sides.items()}
    base, other = list(sides)
    stop = (int(tok.eos_token_id),)

    def sampling(seed: int, greedy: bool = False) -> SamplingParams:
        return SamplingParams(max_new_tokens=tokens, temperature=0.0 if greedy else 1.0, n=samples, seed=seed,
                              stop_token_ids=stop)  # fmt: skip

    greedy = {k: e.generate(ids, mask, sampling(0, greedy=True)) for k, e in engines.items()}
    seed = dict.fromkeys(sides, 0)
    outputs: dict[str, list] = {k: [] for k in sides}

    def side(name: str):
        def call():
            seed[name] += 1
            outputs[name].append(engines[name].generate(ids, mask, sampling(seed[name])))

        return call

    got = alternate({name: side(name) for name in sides}, repeats)
    timed_out = {k: v[-repeats:] for k, v in outputs.items()}  # the warm-up's outputs come first
    cell = {"prompts": prompts, "samples": samples, "max_tokens": tokens, "prompt_len": int(ids.shape[1]),
            "seconds": got, base: stats(got[base]), other: stats(got[other]),
            "speedup": stats([a / b for a, b in zip(got[base], got[other], strict=True)]),
            "response_tokens": {k: sum(int(o.response_mask.sum()) for o in v) for k, v in timed_out.items()},
            **identical_outputs((greedy[base], greedy[other]), timed_out[base], timed_out[other])}
    return cell, engines


def engine_pair_line(cell: dict[str, Any], base: str, other: str) -> str:
    """The progress line of an :func:`engine_pair_cell` cell."""
    sp = cell["speedup"]
    return (f"{base} {cell[base]['median']:.2f} s, {other} {cell[other]['median']:.2f} s, "
            f"×{sp['median']:.2f} ({sp['min']:.2f}–{sp['max']:.2f}); greedy identical {cell['greedy_identical_rows']}")


def engine_pair_table(res: dict[str, Any], base: str, other: str, labels: tuple[str, str], timing_note: str) -> str:
    """The docs block of an :func:`engine_pair_cell` benchmark: the "Measured" line and one row per
    cell. labels: the two sides' column names; timing_note: what the seconds include."""
    rows = []
    for c in res["cells"]:
        sp = c["speedup"]
        rows.append((f"{c['prompts']} × {c['samples']}", c["max_tokens"], f"{c[base]['median']:.2f}",
                     f"{c[other]['median']:.2f}", f"{sp['median']:.2f} ({sp['min']:.2f}–{sp['max']:.2f})",
                     f"{c['response_tokens'][base]} / {c['response_tokens'][other]}",
                     f"{c['greedy_identical_rows'][0]} / {c['greedy_identical_rows'][1]} ({c['greedy_max_log_prob_gap']:.1e})",
                     f"{c['identical_rows'][0]} / {c['identical_rows'][1]} ({c['max_log_prob_gap_identical_rows']:.1e})"))
    a, b = labels
    table = markdown_table(
        ["prompts × samples", "max tokens", f"{a} s", f"{b} s", f"{a} ÷ {b}, median (min–max)",
         f"response tokens {a} / {b}", "greedy identical rows (max Δ log-prob)",
         "sampled identical rows (max Δ log-prob)"], rows)
    return "\n\n".join([
        measured_under(res["environment"]) + f" Model `{res['model']}`, temperature 1, EOS stop, "
        f"{res['repeats']} alternating runs per side after a warm-up; seconds are medians, {timing_note}.",
        table,
    ])


def measure_cells(model_path: str, cells: Sequence[tuple[int, int, int]], repeats: int,
                  run_cell: Callable[..., dict[str, Any]], line: Callable[[dict[str, Any]], str]) -> dict[str, Any]:
    """Load ``model_path`` once and run ``run_cell(model, tok, p, s, t, repeats)`` per cell,
    printing ``line(cell)`` after each. Returns {"model", "repeats", "cells"}."""
    model, tok = load_model(model_path)
    out = []
    for p, s, t in cells:
        cell = run_cell(model, tok, p, s, t, repeats)
        out.append(cell)
        print(f"{p}×{s}, ≤{t} tokens: " + line(cell), flush=True)
    return {"model": model_path, "repeats": repeats, "cells": out}


def cells_main(name: str, doc: str, default_cells: str, measure: Callable[[str, list, int], dict[str, Any]],
               render: Callable[[dict[str, Any]], str], argv: list[str] | None) -> int:
    """The command line of a rollout cell benchmark: --model, --cells, --repeats, --threads,
    --out, --no-docs; writes bench/results/NAME.json and the NAME block of docs/benchmarks.md."""
    import argparse

    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--model", default=DEMO_MODEL, help="model.path (default: the demo model)")
    p.add_argument("--cells", default=default_cells, help="comma-separated PROMPTSxSAMPLESxTOKENS cells")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per side (at least 1)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--no-docs", action="store_true")
    args = p.parse_args(argv)
    try:
        cells = parse_cells(args.cells)
    except ValueError as exc:
        p.error(str(exc))
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: at least 1 timed run per side")
    set_threads(args.threads)
    res = write_result_and_render(name, measure(args.model, cells, args.repeats), render,
                                  out=args.out, docs=not args.no_docs)  # fmt: skip
    return 0 if res else 1
