"""Asynchronous training against synchronous, side by side: the demo's GRPO run as
examples/grpo_arith.yaml (``sync``: one colocated pool, 2 torch threads), as
examples/grpo_arith_async.yaml (``async``: ``trainer.max_staleness: 1``, whole rollouts generated
ahead; a rollout pool and a trainer pool, 1 torch thread each, ``tis`` correction) and as
examples/grpo_arith_stream.yaml (``stream``: ``trainer.async_mode: stream``, prompt groups
generated continuously on the rollout pool with partial rollouts across weight updates; the same
pools, staleness bound and correction), each a real ``hybridflow train`` run.

    hybridflow bench async [--iterations 5] [--configs sync,async,stream]
                           [--variant NAME=KEY=VALUE[,KEY=VALUE]] ... [--extra KEY=VALUE]
                           [--from-runs NAME=SYNC_DIR,ASYNC_DIR[,STREAM_DIR]] [--runs-iterations FIRST..LAST]
                           [--no-default-variants] [--out PATH] [--no-docs]

Each variant (the demo's settings, plus by default ``rollout.samples_per_prompt=4``) runs every
configuration of ``--configs`` (default all three), in that order for the first variant and in
the reverse order for the next (sync async stream, stream async sync, ...), each a fresh
``hybridflow train`` subprocess with validation off and checkpoints only at the end (outside the
timed iterations). Iteration 1 is a warm-up and is dropped; the ``async`` and ``stream`` runs do
one extra iteration at the end, also dropped, because with nothing left to generate ahead the last
iteration does not overlap (a drain, not the steady state). So each run is timed on iterations
2 … N.

Reported per configuration (medians over the timed iterations, from the run's metrics.jsonl):
``timing_s/iteration_wall`` (the driver's wall time per iteration, including waiting for the
rollout), tokens/s = ``perf/total_num_tokens`` (prompt + response) / iteration wall, the phases
``timing_s/gen`` (for ``stream``: the take node's wall time, generation itself overlapped),
``timing_s/old_log_probs``, ``timing_s/update_actor``, ``timing_s/weight_sync``,
``timing_s/reward``, ``timing_s/adv``, and ``async/overlap_fraction``; the ratios async ÷ sync and
stream ÷ sync of the medians (where both sides were measured). From the phase times, per
overlapped configuration, the speedup to expect when rollout and training each have a device of
their own (:func:`expected_speedup`). Writes bench/results/async.json and the ``async`` table of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

CONFIGS = {"sync": "examples/grpo_arith.yaml", "async": "examples/grpo_arith_async.yaml",
           "stream": "examples/grpo_arith_stream.yaml"}
OVERLAPPED = ("async", "stream")  # generate while the trainer trains: one drain iteration each, compared with sync
RATIO_KEYS = {"async": "ratio_async_to_sync", "stream": "ratio_stream_to_sync"}
PROJECTION_KEYS = {"async": "expected_dedicated", "stream": "expected_dedicated_stream"}
PHASES = {"gen": "timing_s/gen", "old_log_probs": "timing_s/old_log_probs", "reward": "timing_s/reward",
          "adv": "timing_s/adv", "update_actor": "timing_s/update_actor", "weight_sync": "timing_s/weight_sync"}
DEMO_TRAIN = common.ROOT / "data" / "arith" / "train.parquet"
DEFAULT_VARIANTS = {"demo": {}, "samples_per_prompt=4": {"rollout.samples_per_prompt": "4"}}


# ---- one run -------------------------------------------------------------------------------------


def run_overrides(config: str, iterations: int, run_dir: str, train_file: str,
                  extra: dict[str, str]) -> list[str]:
    """Dotted overrides of one timed run, as ``KEY=VALUE`` strings: ``iterations`` (+1 drain
    iteration for ``async`` and ``stream``), validation off, one checkpoint at the end, the bench's
    own run dir and MLflow store, then ``extra``."""
    ov = {"trainer.run_id": config, "trainer.run_dir": run_dir,
          "trainer.total_iterations": iterations + (1 if config in OVERLAPPED else 0),
          "trainer.val_every": 0, "trainer.val_before_train": "false", "trainer.save_every": 0,
          "data.train_files": f"[{train_file}]", "data.val_files": f"[{train_file}]",
          "tracking.mlflow_uri": f"sqlite:///{run_dir}/mlflow.db", **extra}
    return [f"{k}={v}" for k, v in ov.items()]


def read_iterations(metrics_path: str | Path) -> list[dict[str, Any]]:
    """The per-iteration rows of a run's metrics.jsonl: [{"iteration": k, "metrics": {...}}],
    only those that carry ``timing_s/iteration_wall``, by iteration."""
    rows = []
    for line in Path(metrics_path).read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if "iteration" in rec and "timing_s/iteration_wall" in rec.get("metrics", {}):
            rows.append(rec)
    return sorted(rows, key=lambda r: r["iteration"])


def iteration_row(rec: dict[str, Any]) -> dict[str, Any]:
    """One timed iteration: wall seconds, tokens (prompt + response), tokens/s, phase seconds
    (0 for a phase the configuration does not run), overlap fraction and staleness."""
    m = rec["metrics"]
    wall = float(m["timing_s/iteration_wall"])
    tokens = float(m.get("perf/total_num_tokens", 0.0))
    return {"iteration": rec["iteration"], "wall_s": wall, "tokens": tokens,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "phases_s": {name: float(m.get(key, 0.0)) for name, key in PHASES.items()},
            "overlap_fraction": float(m.get("async/overlap_fraction", 0.0)),
            "staleness_mean": float(m.get("rollout/staleness/mean", 0.0)),
            "score_mean": float(m.get("critic/score/mean", float("nan")))}


def timed_rows(records: list[dict[str, Any]], iterations: int, first: int = 2) -> list[dict[str, Any]]:
    """The :func:`iteration_row` of iterations ``first`` … ``iterations`` (1 is the warm-up; an async
    or stream run's extra last one, the drain, is cut)."""
    return [iteration_row(r) for r in records if first <= r["iteration"] <= iterations]


def run_config(config: str, iterations: int, workdir: Path, train_file: str, extra: dict[str, str],
               timeout_s: float) -> dict[str, Any]:
    """Run ``hybridflow train`` on ``CONFIGS[config]`` in a subprocess; returns its timed
    iterations, the load average before and after, and the whole run's wall seconds.
    Raises RuntimeError (with the log's tail) when the run fails."""
    run_dir = workdir / config
    cmd = [sys.executable, "-m", "flows.cli", "train", "-c", str(common.ROOT / CONFIGS[config]),
           *run_overrides(config, iterations, str(run_dir), train_file, extra)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(common.ROOT), os.environ.get("PYTHONPATH")])),
               TOKENIZERS_PARALLELISM="false")
    load_before = [round(x, 2) for x in os.getloadavg()]
    t0 = time.perf_counter()
    log = workdir / f"{config}.log"
    with log.open("w") as fh:
        proc = subprocess.run(cmd, cwd=common.ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{config} run failed (rc {proc.returncode}):\n" + log.read_text()[-3000:])
    rows = timed_rows(read_iterations(run_dir / config / "metrics.jsonl"), iterations)
    if not rows:
        raise RuntimeError(f"{config} run logged no timed iterations (need --iterations ≥ 2)")
    print(f"  {config}: {len(rows)} timed iterations, median "
          f"{common.stats([r['wall_s'] for r in rows])['median']:.1f} s/iteration", flush=True)
    return {"command": cmd[2:], "load_avg_before": load_before, "load_avg_after": [round(x, 2) for x in os.getloadavg()],
            "run_wall_s": wall, "iterations": rows}


# ---- summaries -----------------------------------------------------------------------------------


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Min/median/max of wall, tokens/s, each phase and the overlap over timed iterations."""
    return {"wall_s": common.stats([r["wall_s"] for r in rows]),
            "tokens_per_s": common.stats([r["tokens_per_s"] for r in rows]),
            "phases_s": {k: common.stats([r["phases_s"][k] for r in rows]) for k in PHASES},
            "overlap_fraction": common.stats([r["overlap_fraction"] for r in rows]),
            "staleness_mean": common.stats([r["staleness_mean"] for r in rows])}


def ratios(sync: dict[str, Any], asyn: dict[str, Any]) -> dict[str, float | None]:
    """Overlapped ÷ sync of the medians (``asyn``: the summary of an ``async`` or ``stream`` run):
    wall (< 1: the overlapped run faster), tokens/s (> 1: faster), each phase (None where the sync
    run does not have that phase)."""
    def div(a: float, b: float) -> float | None:
        return a / b if b > 0 else None

    out = {"wall_s": div(asyn["wall_s"]["median"], sync["wall_s"]["median"]),
           "tokens_per_s": div(asyn["tokens_per_s"]["median"], sync["tokens_per_s"]["median"])}
    for k in PHASES:
        out[k] = div(asyn["phases_s"][k]["median"], sync["phases_s"][k]["median"])
    return out


def expected_speedup(sync: dict[str, Any], asyn: dict[str, Any]) -> dict[str, float]:
    """The speedup to expect with a device each for rollout and training, from medians (seconds):
    {gen_s, train_s, old_log_probs_s, weight_sync_s, overhead_s, sync_s, one_step_off_s, speedup,
    bound}. ``asyn`` is the summary of an overlapped run, ``async`` or ``stream`` (both generate
    while the trainer trains, at most one weights version behind).

    gen and train are the synchronous run's (2 threads: the speed of a dedicated device of this
    kind); train = reward + adv + update_actor. The overlapped trainer also recomputes
    old log-probs (the proximal policy ``tis`` needs; the sync run takes them from the rollout
    engine): its time is the overlapped run's, scaled to 2 threads by update_sync / update_overlapped.
    overhead = sync wall − gen − train (Prefect dispatch, batch load/save). Then
    sync ≈ gen + train + overhead (the measured sync wall) and overlapped (``one_step_off_s``) ≈
    max(gen, old_log_probs + train + weight_sync) + overhead; speedup = sync ÷ overlapped.
    ``bound`` = (gen + train) ÷ max(gen, train): the most any overlap could give. For ``stream``
    the re-prefill of partial rollouts (``stream/prefill_tokens``) is rollout-side work this does
    not count: it is hidden while the trainer's side is the longer one.
    """
    p, q = ({k: v["median"] for k, v in s["phases_s"].items()} for s in (sync, asyn))
    gen, train = p["gen"], p["reward"] + p["adv"] + p["update_actor"]
    scale = p["update_actor"] / q["update_actor"] if q["update_actor"] > 0 else 1.0
    old_lp = q["old_log_probs"] * scale
    wall = sync["wall_s"]["median"]
    overhead = max(0.0, wall - gen - train)
    one_step = max(gen, old_lp + train + q["weight_sync"]) + overhead
    return {"gen_s": gen, "train_s": train, "old_log_probs_s": old_lp, "weight_sync_s": q["weight_sync"],
            "overhead_s": overhead, "sync_s": wall, "one_step_off_s": one_step, "speedup": wall / one_step,
            "bound": (gen + train) / max(gen, train) if max(gen, train) > 0 else 1.0}


# ---- the benchmark -------------------------------------------------------------------------------


def ensure_train_file(workdir: Path, prompts: int = 256) -> str:
    """The demo's data/arith/train.parquet when present, else ``prompts`` generated arithmetic rows."""
    if DEMO_TRAIN.exists():
        return str(DEMO_TRAIN)
    return common.write_arith_file(workdir / "train.jsonl", prompts, seed=0)


def compare(summary: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """For each overlapped configuration measured alongside ``sync`` in ``summary`` ({config:
    :func:`summarize`}): its :func:`ratios` to sync under ``RATIO_KEYS[config]`` and its
    :func:`expected_speedup` under ``PROJECTION_KEYS[config]``; {} without a sync run."""
    out: dict[str, dict[str, Any]] = {}
    if "sync" not in summary:
        return out
    for config in OVERLAPPED:
        if config in summary:
            out[RATIO_KEYS[config]] = ratios(summary["sync"], summary[config])
            out[PROJECTION_KEYS[config]] = expected_speedup(summary["sync"], summary[config])
    return out


def measure_variant(name: str, overrides: dict[str, str], order: list[str], iterations: int, workdir: Path,
                    train_file: str, timeout_s: float) -> dict[str, Any]:
    """The configurations ``order`` on one variant, run in that order; returns their runs, summaries
    (in ``CONFIGS`` order) and :func:`compare`'s ratios and projections."""
    print(f"variant {name}: {' then '.join(order)}", flush=True)
    runs = {}
    for config in order:
        d = workdir / name.replace("=", "_") / config
        d.mkdir(parents=True, exist_ok=True)
        runs[config] = run_config(config, iterations, d, train_file, overrides, timeout_s)
    summary = {c: summarize(runs[c]["iterations"]) for c in CONFIGS if c in runs}
    return {"overrides": overrides, "order": order, "runs": runs, "summary": summary, **compare(summary)}


def from_runs(sync_dir: str | Path, async_dir: str | Path, iterations: int, first: int = 2,
              stream_dir: str | Path | None = None) -> dict[str, Any]:
    """A variant read from finished (or stopped) ``hybridflow train`` run folders, one per
    configuration (sync, async and optionally stream), e.g. the learning runs of docs/results.md:
    their iterations ``first`` … ``iterations`` (keep an async or stream run's last iteration, the
    drain, and any iteration right after a validation or a resume out of the range). Returns the
    variant (runs, summaries, :func:`compare`'s ratios and projections). Raises ValueError when a
    run has none of those iterations."""
    runs = {}
    dirs = [("sync", sync_dir), ("async", async_dir)] + ([("stream", stream_dir)] if stream_dir is not None else [])
    for config, d in dirs:
        rows = timed_rows(read_iterations(Path(d) / "metrics.jsonl"), iterations, first)
        if not rows:
            raise ValueError(f"{d}: no iterations {first}..{iterations} in metrics.jsonl")
        runs[config] = {"run_dir": str(d), "iterations": rows}
    summary = {c: summarize(runs[c]["iterations"]) for c in CONFIGS if c in runs}
    return {"source": "run folders", "timed_iterations": f"{first}..{iterations}", "runs": runs, "summary": summary,
            **compare(summary)}


def measure(variants: dict[str, dict[str, str]], iterations: int, extra: dict[str, str],
            workdir: str | None = None, timeout_s: float = 1800,
            runs: dict[str, tuple[str, ...]] | None = None,
            runs_iterations: tuple[int, int] | None = None,
            configs: list[str] | None = None) -> dict[str, Any]:
    """Every variant (its overrides on top of ``extra``) on each of ``configs`` (default all of
    ``CONFIGS``), in that order for even variants and reversed for odd ones; first the variants
    read from run folders (``runs``: {name: (sync dir, async dir[, stream dir])}, their iterations
    ``runs_iterations`` = (first, last), default 2 … ``iterations``). Returns the result: the
    variants by name plus the settings and the load average before and after."""
    configs = list(configs or CONFIGS)
    load_before = [round(x, 2) for x in os.getloadavg()]
    out: dict[str, Any] = {"iterations": iterations, "timed_iterations": f"2..{iterations}",
                           "configs": {c: CONFIGS[c] for c in configs}, "extra_overrides": extra,
                           "load_avg_before": load_before, "variants": {}}
    for name, dirs in (runs or {}).items():
        first, last = runs_iterations or (2, iterations)
        out["variants"][name] = from_runs(dirs[0], dirs[1], last, first, stream_dir=dirs[2] if len(dirs) > 2 else None)
    with tempfile.TemporaryDirectory(prefix="hybridflow-bench-async-", dir=workdir) as d:
        train_file = ensure_train_file(Path(d))
        out["train_file"] = str(Path(train_file).relative_to(common.ROOT)) if train_file == str(DEMO_TRAIN) else "generated"
        for i, (name, ov) in enumerate(variants.items()):
            order = configs if i % 2 == 0 else configs[::-1]
            out["variants"][name] = measure_variant(name, {**extra, **ov}, order, iterations, Path(d),
                                                    train_file, timeout_s)
    out["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    return out


# ---- rendering -----------------------------------------------------------------------------------


def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "—" if x is None else fmt.format(x)


def _variant_rows(name: str, v: dict[str, Any]) -> list[tuple]:
    """The measured table's rows of one variant: one per configuration it has (in ``CONFIGS``
    order), then one per ratio to sync it has ("async ÷ sync", "stream ÷ sync")."""
    rows = []
    for c in (c for c in CONFIGS if c in v["summary"]):
        s = v["summary"][c]
        ph = {k: x["median"] for k, x in s["phases_s"].items()}
        rows.append((name, c, _f(s["wall_s"]["median"]), _f(s["tokens_per_s"]["median"]), _f(ph["gen"]),
                     _f(ph["old_log_probs"] or None), _f(ph["update_actor"]), _f(ph["weight_sync"] or None),
                     _f(s["overlap_fraction"]["median"], "{:.2f}")))
    for c in OVERLAPPED:
        r = v.get(RATIO_KEYS[c])
        if r is not None:
            rows.append((name, f"{c} ÷ sync", _f(r["wall_s"], "{:.2f}"), _f(r["tokens_per_s"], "{:.2f}"),
                         _f(r["gen"], "{:.2f}"), "—", _f(r["update_actor"], "{:.2f}"), "—", ""))
    return rows


def _projection_rows(name: str, v: dict[str, Any]) -> list[tuple]:
    """The projection table's rows of one variant: one per overlapped configuration it has a
    projection for."""
    rows = []
    for c in OVERLAPPED:
        e = v.get(PROJECTION_KEYS[c])
        if e is not None:
            rows.append((name, c, _f(e["gen_s"]), _f(e["train_s"]), _f(e["old_log_probs_s"]), _f(e["weight_sync_s"]),
                         _f(e["overhead_s"]), _f(e["sync_s"]), _f(e["one_step_off_s"]), _f(e["speedup"], "{:.2f}×"),
                         _f(e["bound"], "{:.2f}×")))
    return rows


def render(res: dict[str, Any]) -> str:
    """The ``async`` block of docs/benchmarks.md: the measured table (each variant's configurations
    and its ratios to sync, only those measured) and, where a variant has sync and an overlapped
    configuration, the projection per overlapped configuration."""
    n = res["iterations"]
    b, a = res["load_avg_before"], res["load_avg_after"]
    drained = [c for c in OVERLAPPED if c in res.get("configs", CONFIGS)]
    runs_of = " and ".join(drained) + (" runs'" if len(drained) > 1 else " run's")
    drain = f"; the {runs_of} drain iteration {n + 1} is cut" if drained else ""
    head = (common.measured_under(res["environment"]) + f" Load average before {b[0]:.2f} / {b[1]:.2f} / {b[2]:.2f}, "
            f"after {a[0]:.2f} / {a[1]:.2f} / {a[2]:.2f}. Medians of iterations 2–{n} (iteration 1 is a warm-up"
            f"{drain}); validation off; data `{res['train_file']}`.")
    for name, v in res["variants"].items():
        if v.get("source") == "run folders":
            head += (f" Setting *{name}*: read from the run folders {', '.join(r['run_dir'] for r in v['runs'].values())}"
                     f" (one after the other, not alternated), medians of iterations {v['timed_iterations'].replace('..', '–')}.")
    rows = [row for name, v in res["variants"].items() for row in _variant_rows(name, v)]
    table = common.markdown_table(["setting", "configuration", "iteration s", "tokens/s", "gen s", "old log-probs s",
                                   "update s", "weight sync s", "overlap fraction"], rows, align="ll" + "r" * 7)
    proj = [row for name, v in res["variants"].items() for row in _projection_rows(name, v)]
    if not proj:
        return head + "\n\n" + table
    ptable = common.markdown_table(["setting", "configuration", "gen s", "train s", "old log-probs s", "weight sync s",
                                    "overhead s", "sync ≈ gen + train + overhead",
                                    "overlapped ≈ max(gen, old lp + train + sync) + overhead",
                                    "expected speedup", "bound (gen + train) ÷ max"], proj, align="ll" + "r" * 9)
    return (head + "\n\n" + table + "\n\nExpected with a device each for rollout and training, per overlapped "
            "configuration (gen and train from the synchronous run at 2 threads; old log-probs and weight sync "
            "from that configuration's run, old log-probs scaled to 2 threads):\n\n" + ptable)


def _variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, rest = text.partition("=")
    if not name or not rest or "=" not in rest:
        raise argparse.ArgumentTypeError(f"--variant takes NAME=KEY=VALUE[,KEY=VALUE], got {text!r}")
    return name, dict(kv.split("=", 1) for kv in rest.split(",") if kv.strip())


def _range(text: str) -> tuple[int, int]:
    a, sep, b = text.partition("..")
    if not sep or not a.isdigit() or not b.isdigit() or int(a) > int(b):
        raise argparse.ArgumentTypeError(f"--runs-iterations takes FIRST..LAST, got {text!r}")
    return int(a), int(b)


def _run_dirs(text: str) -> tuple[str, tuple[str, ...]]:
    """``NAME=SYNC_DIR,ASYNC_DIR[,STREAM_DIR]`` → (name, (sync dir, async dir[, stream dir]))."""
    name, _, rest = text.partition("=")
    dirs = rest.split(",")
    if not name or len(dirs) not in (2, 3) or not all(dirs):
        raise argparse.ArgumentTypeError(
            f"--from-runs takes NAME=SYNC_RUN_DIR,ASYNC_RUN_DIR[,STREAM_RUN_DIR], got {text!r}")
    return name, tuple(dirs)


def _configs(text: str) -> list[str]:
    """``--configs``: a comma list of ``CONFIGS`` names, each once → the list, in the order given
    (the run order of the first variant)."""
    names = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if not names or unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"--configs takes a comma list of {', '.join(CONFIGS)}, each at most once, got {text!r}")
    return names


def main(argv: list[str] | None = None) -> int:
    """``hybridflow bench async`` (module docstring): measure, write the result and the docs block;
    returns the exit status, 0."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=5, help="iterations per run (iteration 1 is dropped)")
    p.add_argument("--variant", type=_variant, action="append", default=[], metavar="NAME=KEY=VALUE[,KEY=VALUE]",
                   help="a setting to measure beyond the defaults (repeatable)")
    p.add_argument("--no-default-variants", action="store_true", help="measure only the --variant settings")
    p.add_argument("--configs", type=_configs, default=",".join(CONFIGS), metavar="NAME[,NAME]",
                   help=f"the configurations each variant runs, in this order (default {','.join(CONFIGS)})")
    p.add_argument("--from-runs", type=_run_dirs, action="append", default=[],
                   metavar="NAME=SYNC_DIR,ASYNC_DIR[,STREAM_DIR]",
                   help="also summarize existing run folders (iterations 2..--runs-iterations), repeatable")
    p.add_argument("--runs-iterations", type=_range, default=None, metavar="FIRST..LAST",
                   help="the timed iterations of --from-runs (default 2..--iterations)")
    p.add_argument("--extra", action="append", default=[], metavar="KEY=VALUE",
                   help="a dotted override for every run (repeatable), e.g. model.path=tiny")
    p.add_argument("--timeout-s", type=float, default=1800, help="per run")
    p.add_argument("--out", default=None)
    p.add_argument("--no-docs", action="store_true")
    args = p.parse_args(argv)
    if args.iterations < 2:
        p.error("--iterations must be ≥ 2 (iteration 1 is a warm-up)")
    bad = [x for x in args.extra if "=" not in x]
    if bad:
        p.error(f"--extra takes KEY=VALUE, got {bad}")
    variants = {} if args.no_default_variants else dict(DEFAULT_VARIANTS)
    variants.update(dict(args.variant))
    if not variants and not args.from_runs:
        p.error("no variant to measure")
    common.exit_cleanly_on_sigterm()
    res = measure(variants, args.iterations, dict(x.split("=", 1) for x in args.extra), timeout_s=args.timeout_s,
                  runs=dict(args.from_runs), runs_iterations=args.runs_iterations, configs=args.configs)
    common.write_result_and_render("async", res, render, out=args.out, docs=not args.no_docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
