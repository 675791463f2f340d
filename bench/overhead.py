"""Orchestration overhead: the part of an iteration's wall time that is not pool compute.

    hybridflow bench overhead [--repeats 3] [--runners ray,thread] [--warm-workers]
                              [--prompts-per-step 8] [--samples-per-prompt 4] [--max-response-tokens 64]

Runs hybridflow iterations (demo settings by default: 8 prompts × 4 samples, 64 new tokens,
mini-batch 16, micro-batch 4) on one set of pools, alternating the Prefect task runner per
iteration: ``ray`` (RayTaskRunner, the default; every node task is a Ray task) and ``thread``
(``trainer.task_runner=thread``; node tasks are threads of the driver). Per iteration:

- compute: time the pool actors spent executing their methods (generation, log-probs,
  rewards, the update), summed from Ray's task events (``ray.timeline``) in the iteration's window;
- Ray actor calls: those actor tasks' time outside execution (argument deserialisation, result
  store) plus health pings;
- batch storage: ``Batch.save`` / ``BatchRef.load`` time (measured in-process, so for the
  thread runner; the ray runner does the same work in its task processes);
- the rest: Prefect task submission, state tracking against the API, Ray task scheduling and
  worker-process start-up, config re-validation and pool look-ups in each node.

overhead = (wall − compute) / wall. ``--warm-workers`` repeats the whole measurement on a
fresh Ray started with idle worker processes kept alive (``idle_worker_killing_time_threshold_ms``),
to show how much of the ray runner's cost is starting a Python worker for each node task.
Writes bench/results/overhead.json and the ``overhead`` table of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from bench.harness import HybridflowRunner, Settings  # noqa: E402

WARM_WORKERS = {"idle_worker_killing_time_threshold_ms": 3_600_000, "num_workers_soft_limit": 16}


class StorageTimer:
    """Accumulates Batch.save / BatchRef.load seconds in this process (thread-safe enough: += on floats)."""

    def __init__(self) -> None:
        from hybridflow.batch import Batch, BatchRef

        self.seconds = 0.0
        self.calls = 0
        self._restore = [(Batch, "save", Batch.save), (BatchRef, "load", BatchRef.load)]
        for cls, name, fn in self._restore:
            setattr(cls, name, self._wrap(fn))

    def _wrap(self, fn):
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        return wrapper

    def take(self) -> tuple[float, int]:
        out = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return out

    def close(self) -> None:
        for cls, name, fn in self._restore:
            setattr(cls, name, fn)


def actor_times(events: list[dict], t0: float, t1: float) -> dict[str, float]:
    """Sum the pool actors' task events inside [t0, t1] (epoch seconds): ``compute`` (execution of
    WorkerHost.call, or call_logged, which node tasks use), ``actor_call_overhead`` (the rest of
    those tasks, plus pings)."""
    lo, hi = t0 * 1e6, t1 * 1e6
    total: dict[str, float] = defaultdict(float)
    for e in events:
        ts, dur = float(e.get("ts", 0.0)), float(e.get("dur", 0.0) or 0.0)
        if not lo <= ts <= hi:
            continue
        cat = str(e.get("cat", ""))
        if cat.startswith("task::WorkerHost.call"):
            total["call"] += dur / 1e6
        elif cat.startswith("task::WorkerHost.ping"):
            total["ping"] += dur / 1e6
        elif cat == "task:execute" and e.get("_parent") in ("call", "call_logged"):  # call_logged: workers/worker_logs.py
            total["compute"] += dur / 1e6
    return {"compute": total["compute"], "actor_call_overhead": total["call"] - total["compute"] + total["ping"]}


def tag_execute_events(events: list[dict]) -> list[dict]:
    """Mark each ``task:execute`` event with the actor method it belongs to (same pid, inside it)."""
    parents = [e for e in events if str(e.get("cat", "")).startswith("task::WorkerHost.")]
    by_pid: dict[Any, list[dict]] = defaultdict(list)
    for p in parents:
        by_pid[p.get("pid")].append(p)
    for e in events:
        if e.get("cat") != "task:execute":
            continue
        for p in by_pid.get(e.get("pid"), []):
            if p["ts"] <= e["ts"] <= p["ts"] + p.get("dur", 0):
                e["_parent"] = p.get("name")
                break
    return events


def run_variant(s: Settings, runners: list[str], repeats: int, system_config: dict | None,
                warmup_rounds: int = 1) -> dict[str, Any]:
    import ray

    from tasks.common import read_execution_log

    hf = HybridflowRunner(s, prompts=256, ray_system_config=system_config).start()
    storage = StorageTimer()
    iters: list[dict[str, Any]] = []
    try:
        for r in range(1 - warmup_rounds, repeats + 1):  # rounds ≤ 0 warm up
            for tr in runners if r % 2 == 1 else runners[::-1]:
                storage.take()
                out = hf.iteration(tr)
                seconds, calls = storage.take()
                iters.append({"round": r, "runner": tr, "iteration": hf.it, "wall_s": out["wall_s"], "t0": out["t0"],
                              "t1": out["t1"], "storage_s": seconds, "storage_calls": calls,
                              "node_s": {k: v for k, v in out["metrics"].items() if k.startswith("timing_s/")}})
                print(f"{tr}: {out['wall_s']:.1f}s", flush=True)
        time.sleep(2.0)  # let the task events reach the GCS
        events = tag_execute_events(ray.timeline())
        log = read_execution_log(hf.base.run_dir)
    finally:
        storage.close()
        hf.stop()
    seen: set[int] = set()
    for it in iters:
        it.update(actor_times(events, it["t0"], it["t1"]))
        pids = {e["pid"] for e in log if e["iteration"] == it["iteration"]}
        it["node_processes"], it["new_node_processes"] = len(pids), len(pids - seen)
        seen |= pids
    return {"system_config": system_config, "iterations": iters,
            "summary": {tr: summarize([i for i in iters if i["runner"] == tr and i["round"] > 0]) for tr in runners}}


def summarize(iters: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str) -> float:
        return common.stats([i[key] for i in iters])["median"]

    fractions = [(i["wall_s"] - i["compute"]) / i["wall_s"] for i in iters]
    return {"wall_s": common.stats([i["wall_s"] for i in iters]), "compute_s": med("compute"),
            "actor_call_overhead_s": med("actor_call_overhead"), "storage_s": med("storage_s"),
            "other_s": common.stats([i["wall_s"] - i["compute"] - i["actor_call_overhead"] - i["storage_s"]
                                     for i in iters])["median"],
            "overhead_fraction": common.stats(fractions), "new_node_processes": med("new_node_processes")}


def measure(s: Settings, runners: list[str], repeats: int, warm: bool, warmup_rounds: int = 1) -> dict[str, Any]:
    variants = {"default Ray": run_variant(s, runners, repeats, None, warmup_rounds)}
    if warm:
        variants["warm Ray workers"] = run_variant(s, runners, repeats, WARM_WORKERS, warmup_rounds)
    return {"settings": vars(s) | {"trajectories": s.trajectories}, "repeats": repeats, "variants": variants}


def render(res: dict) -> str:
    s = res["settings"]
    rows = []
    for name, v in res["variants"].items():
        for tr, x in v["summary"].items():
            f = x["overhead_fraction"]
            rows.append((f"{tr} ({name})", f"{x['wall_s']['median']:.1f}", f"{x['compute_s']:.1f}",
                         f"{x['actor_call_overhead_s']:.2f}", f"{x['storage_s']:.2f}" if tr == "thread" else "—",
                         f"{x['other_s']:.1f}", f"{x['new_node_processes']:.0f}",
                         f"{100 * f['median']:.1f}% ({100 * f['min']:.1f}–{100 * f['max']:.1f})"))
    head = (common.measured_under(res["environment"]) + f" Model `{s['model']}`; {s['prompts_per_step']} prompts × "
            f"{s['samples_per_prompt']} samples, ≤ {s['max_response_tokens']} new tokens, mini-batch "
            f"{s['mini_batch_trajectories']}, micro-batch {s['micro_batch_trajectories']}; {res['repeats']} "
            "alternating iterations per task runner after one warm-up round; medians.")
    table = common.markdown_table(
        ["task runner (Ray)", "iteration s", "pool compute s", "Ray actor calls s", "batch storage s",
         "Prefect + Ray tasks + rest s", "new node-task processes", "overhead, median (min–max)"], rows)
    return head + "\n\n" + table


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=common.DEMO_MODEL)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument("--max-response-tokens", type=int, default=64)
    p.add_argument("--mini", type=int, default=16)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--threads", type=int, default=2, help="torch threads of the policy pool")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--runners", type=_csv, default=["ray", "thread"])
    p.add_argument("--warmup-rounds", type=int, default=1, help="untimed rounds first (each runs every runner)")
    p.add_argument("--warm-workers", action="store_true", help="also measure with idle Ray workers kept alive")
    p.add_argument("--out", default=None)
    p.add_argument("--no-docs", action="store_true")
    args = p.parse_args(argv)
    common.exit_cleanly_on_sigterm()
    s = Settings(model=args.model, prompts_per_step=args.prompts_per_step, samples_per_prompt=args.samples_per_prompt,
                 max_response_tokens=args.max_response_tokens, mini_batch_trajectories=args.mini,
                 micro_batch_trajectories=args.micro, threads=args.threads)
    common.write_result_and_render("overhead", measure(s, args.runners, args.repeats, args.warm_workers,
                                                                 args.warmup_rounds), render,
                                   out=args.out, docs=not args.no_docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
