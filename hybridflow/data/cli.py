"""``hybridflow data``: write verl-format datasets (parquet or jsonl, by the --out suffix).

    hybridflow data gsm8k train.jsonl --out data/gsm8k_train.parquet [--split train] [--limit N]
    hybridflow data arith --out data/arith.parquet --n 1000 --difficulty 1 --seed 0
    hybridflow data countdown --out data/countdown.parquet --n 1000 --seed 0 [--min-numbers 3 ...]
    hybridflow data reasoning-gym --dataset chain_sum[,leg_counting] --n 1000 --seed 0 \
        [--config max_terms=3 ...] --out data/rg.parquet [--test-out data/rg_test.parquet --test-n 256]
    hybridflow data verifiers --env my_env.py:load_environment --n 256 --out data/my_env.parquet
    hybridflow data textarena --env GuessTheNumber-v0 --n 512 --seed 0 --out data/guess.parquet \
        [--test-out data/guess_test.parquet --test-n 64] [--system-prompt TEXT]
    hybridflow data lm-eval-task --from data/arith/test.parquet --name arith_local --out evals/lm_eval

No heavy imports at module top (``hybridflow --help`` imports this module).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="task", required=True, metavar="TASK")
    g = sub.add_parser("gsm8k", help="convert the public GSM8K jsonl (question / answer with '#### N')")
    g.add_argument("input", help="GSM8K jsonl file (e.g. train.jsonl from openai/grade-school-math)")
    g.add_argument("--split", default="train", help="split name recorded in extra_info (default: train)")
    g.add_argument("--limit", type=int, default=None, help="keep only the first N problems")
    a = sub.add_parser("arith", help="generated arithmetic problems with a difficulty knob")
    a.add_argument("--n", type=int, default=1000, help="number of problems (default: 1000)")
    a.add_argument("--difficulty", type=int, default=1, help="0 (7 + 5) .. 5 (three-step word problems), 6 (347 * 28, for tool use); default 1")
    a.add_argument("--seed", type=int, default=0, help="generator seed (default: 0)")
    a.add_argument("--test-out", default=None,
                   help="also write a held-out split here: problems whose question is not in --out")
    a.add_argument("--test-n", type=int, default=256, help="size of the held-out split (default: 256)")
    c = sub.add_parser("countdown", help="TinyZero's Countdown: reach a target with + - * /")
    c.add_argument("--n", type=int, default=1000, help="number of problems (default: 1000)")
    c.add_argument("--seed", type=int, default=0, help="generator seed (default: 0)")
    c.add_argument("--min-numbers", type=int, default=3, help="fewest given numbers (default: 3)")
    c.add_argument("--max-numbers", type=int, default=4, help="most given numbers (default: 4)")
    c.add_argument("--max-number", type=int, default=99, help="largest given number (default: 99)")
    c.add_argument("--max-target", type=int, default=100, help="largest target (default: 100)")
    r = sub.add_parser("reasoning-gym", help="reasoning-gym's procedural tasks, scored by its own verifiers")
    r.add_argument("--dataset", required=True,
                   help="reasoning-gym dataset name(s), comma-separated (e.g. chain_sum,basic_arithmetic); rows interleave")
    r.add_argument("--n", type=int, default=1000, help="number of problems, all datasets together (default: 1000)")
    r.add_argument("--seed", type=int, default=0, help="generator seed (default: 0)")
    r.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   help="a dataset config value (repeatable): key=value for every listed dataset, "
                        "dataset.key=value for one (e.g. max_terms=3, chain_sum.max_digits=1)")
    r.add_argument("--answer-format", choices=("tags", "boxed"), default="tags",
                   help="what the prompt asks the answer in and the reward reads: <answer> tags (reasoning-gym's "
                        "own convention, default) or \\boxed{}")
    r.add_argument("--test-out", default=None,
                   help="also write a held-out split here: problems whose question is not in --out")
    r.add_argument("--test-n", type=int, default=256, help="size of the held-out split (default: 256)")
    t = sub.add_parser("textarena", help="TextArena single-player games, played and scored by the textarena environment")
    t.add_argument("--env", required=True, help="TextArena id of a single-player game (e.g. GuessTheNumber-v0, TowerOfHanoi-v0)")
    t.add_argument("--n", type=int, default=1000, help="number of games (default: 1000)")
    t.add_argument("--seed", type=int, default=0, help="games use seeds seed*1e6 + i (default: 0)")
    t.add_argument("--system-prompt", default=None, help="a system message before each game's opening")
    t.add_argument("--test-out", default=None, help="also write held-out games here: seeds no training game uses")
    t.add_argument("--test-n", type=int, default=256, help="number of held-out games (default: 256)")
    v = sub.add_parser("verifiers", help="examples of a verifiers environment, played and scored by the verifiers environment")
    which = v.add_mutually_exclusive_group(required=True)
    which.add_argument("--env", help="'file.py:load_environment' or 'pkg.mod:load_environment' returning a verifiers Environment")
    which.add_argument("--env-id", help="an installed verifiers environment (verifiers.load_environment(ID))")
    v.add_argument("--env-args", default=None, metavar="JSON", help="the loader's keyword arguments, a JSON object")
    v.add_argument("--n", type=int, default=None, help="number of examples (default: the whole split after --start)")
    v.add_argument("--start", type=int, default=0, help="first example of the split (default: 0)")
    v.add_argument("--split", choices=("train", "eval"), default="train", help="the environment's dataset (default: train)")
    v.add_argument("--test-out", default=None,
                   help="also write held-out examples here: the eval dataset, or the train examples after --out's")
    v.add_argument("--test-n", type=int, default=64, help="number of held-out examples (default: 64)")
    for p in (g, a, c, r, t, v):
        p.add_argument("--out", "-o", required=True, help="output file: .parquet or .jsonl (any fsspec URI)")
    e = sub.add_parser("lm-eval-task", help="a local lm-eval task (YAML + JSONL) from verl rows, for hybridflow eval --harness")
    e.add_argument("--from", dest="source", required=True, metavar="FILE",
                   help="verl-format rows (.parquet / .jsonl), e.g. data/arith/test.parquet")
    e.add_argument("--name", required=True, help="the task name (letters, digits, _ and -)")
    e.add_argument("--out", "-o", required=True, metavar="DIR", help="folder for <name>.yaml and <name>.jsonl")
    e.add_argument("--limit", type=int, default=None, help="keep only the first N rows")
    e.add_argument("--max-gen-toks", type=int, default=256, help="longest generated answer in tokens (default: 256)")


def held_out(train: list, candidates: Iterable[dict], n: int) -> list:
    """The first ``n`` candidates whose question text is not in ``train`` (deduplicated).
    Raises ValueError when the problem space is too small to hold ``n`` unseen problems."""
    seen = {r["prompt"][-1]["content"] for r in train}
    out = []
    for r in candidates:
        q = r["prompt"][-1]["content"]
        if q not in seen:
            seen.add(q)
            out.append(r)
            if len(out) == n:
                return out
    raise ValueError(f"only {len(out)} problems outside the training set exist at this difficulty; lower --test-n")


def run(args: argparse.Namespace) -> int:
    from hybridflow.agents.loading import AgentLoadError
    from hybridflow.data.io import DataFileError, write_rows
    from hybridflow.data.tasks import gsm8k_rows, make_arith, make_countdown

    if args.task == "lm-eval-task":
        return _lm_eval_task(args)
    if not args.out.endswith((".parquet", ".jsonl")):
        print(f"error: --out {args.out!r} must end in .parquet or .jsonl", file=sys.stderr)
        return 2
    try:
        if args.task == "gsm8k":
            rows = gsm8k_rows(args.input, split=args.split)
            rows = rows[: args.limit] if args.limit is not None else rows
        elif args.task == "arith":
            rows = make_arith(args.n, difficulty=args.difficulty, seed=args.seed)
            if args.test_out:
                test = held_out(rows, make_arith(args.n + 20 * args.test_n, difficulty=args.difficulty,
                                                 seed=args.seed + 1), args.test_n)
                write_rows(test, args.test_out)
                print(f"wrote {len(test)} held-out arith rows (no question shared with --out) to {args.test_out}")
        elif args.task == "reasoning-gym":
            rows = _reasoning_gym(args)
        elif args.task == "textarena":
            rows = _textarena(args)
        elif args.task == "verifiers":
            rows = _verifiers(args)
        else:
            rows = make_countdown(args.n, seed=args.seed, min_numbers=args.min_numbers, max_numbers=args.max_numbers,
                                  max_number=args.max_number, max_target=args.max_target)  # fmt: skip
        write_rows(rows, args.out)
    except (ValueError, FileNotFoundError, DataFileError, AgentLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(rows)} {args.task} rows to {args.out}")
    if rows:
        print(f"first prompt: {rows[0]['prompt'][-1]['content']}")
        print(f"ground truth: {rows[0]['reward_model']['ground_truth']}")
    return 0


def _lm_eval_task(args: argparse.Namespace) -> int:
    """``hybridflow data lm-eval-task``: :func:`hybridflow.evals.lm_eval_tasks.write_local_task`."""
    from hybridflow.data.io import DataFileError, read_records
    from hybridflow.evals.lm_eval_tasks import write_local_task

    try:
        if args.limit is not None and args.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {args.limit}")
        rows = read_records(args.source)[: args.limit]
        task = write_local_task(rows, args.name, args.out, max_gen_toks=args.max_gen_toks)
    except (ValueError, FileNotFoundError, DataFileError) as e:
        print(f"error: {args.source}: {e}", file=sys.stderr)
        return 2
    print(f"wrote lm-eval task {task.name!r} ({task.rows} documents, answers in {task.answer_format}) to "
          f"{task.yaml_path} and {task.docs_path}")
    print(f"run it: hybridflow eval --harness lm-eval --tasks {task.name} --include-path {args.out} --model MODEL")
    return 0


def _reasoning_gym(args: argparse.Namespace) -> list:
    """Train rows (and the held-out split, written here) of ``hybridflow data reasoning-gym``;
    names, keys and the package version are checked before any row is generated."""
    from hybridflow.data.io import write_rows
    from hybridflow.data.tasks.reasoning_gym import iter_reasoning_gym, make_reasoning_gym, parse_overrides

    names = [x.strip() for x in args.dataset.split(",") if x.strip()]
    overrides = parse_overrides(names, args.config)
    rows = make_reasoning_gym(names, args.n, seed=args.seed, overrides=overrides, answer_format=args.answer_format)
    if args.test_out:
        candidates = iter_reasoning_gym(names, args.n + 20 * args.test_n, seed=args.seed, overrides=overrides,
                                        split="test", answer_format=args.answer_format)  # fmt: skip
        test = held_out(rows, candidates, args.test_n)
        write_rows(test, args.test_out)
        print(f"wrote {len(test)} held-out reasoning-gym rows (no question shared with --out) to {args.test_out}")
    return rows


def _textarena(args: argparse.Namespace) -> list:
    """Train games (and the held-out games, written here) of ``hybridflow data textarena``: the
    held-out games take seeds after the training ones (a game with a small space, such as
    GuessTheNumber's 20 targets, can still repeat a training game's secret)."""
    from hybridflow.data.io import write_rows
    from hybridflow.data.tasks.textarena import make_textarena

    rows = make_textarena(args.env, args.n, seed=args.seed, system_prompt=args.system_prompt)
    if args.test_out:
        test = make_textarena(args.env, args.test_n, seed=args.seed, seed_offset=args.n, system_prompt=args.system_prompt)
        write_rows(test, args.test_out)
        print(f"wrote {len(test)} held-out textarena games (seeds after the training games') to {args.test_out}")
    return rows


def _verifiers(args: argparse.Namespace) -> list:
    """Examples (and the held-out ones, written here) of ``hybridflow data verifiers``: held out are
    the environment's eval dataset when it has one, else the train examples after the training rows."""
    import json

    from hybridflow.data.io import write_rows
    from hybridflow.data.tasks.verifiers_rows import dataset_size, make_verifiers

    try:
        env_args = json.loads(args.env_args) if args.env_args else None
    except json.JSONDecodeError as e:
        raise ValueError(f"--env-args {args.env_args!r} is not JSON: {e}") from None
    if env_args is not None and not isinstance(env_args, dict):
        raise ValueError(f"--env-args {args.env_args!r}: a JSON object of keyword arguments")
    where = {"env": args.env, "env_id": args.env_id, "env_args": env_args}
    size, has_eval = dataset_size({k: x for k, x in {**where, "split": args.split}.items() if x is not None})
    n = args.n if args.n is not None else size - args.start
    rows = make_verifiers(**where, n=n, start=args.start, split=args.split)
    if args.test_out:
        if has_eval and args.split == "train":
            test = make_verifiers(**where, n=args.test_n, split="eval")
            source = "the environment's eval dataset"
        else:
            test = make_verifiers(**where, n=args.test_n, start=args.start + n, split=args.split)
            source = f"{args.split} examples after --out's"
        write_rows(test, args.test_out)
        print(f"wrote {len(test)} held-out verifiers examples ({source}) to {args.test_out}")
    return rows
