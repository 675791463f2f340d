"""The chunked LM head against the full logits (``actor.lm_head``): tokens/s and peak RSS of
``PolicyWorker.update_policy``.

    hybridflow bench lm_head [--micro 8] [--seq 256] [--steps 1] [--repeats 2] [--model PATH]

Each side runs in its own subprocess (so ``ru_maxrss``, the process's peak resident memory, is
that side's alone), alternating chunked, full, full, chunked, ... ``--repeats`` times per side.
A subprocess loads the model, builds bench/train.py's synthetic batch (``--steps`` × ``--micro``
trajectories of ``--seq`` tokens, a quarter prompt; its old_log_probs by ``compute_log_probs``
with the same ``actor.lm_head``), then times one ``update_policy`` (``--steps`` optimizer steps,
mini = micro, no warm-up). Reported per side: tokens/s of the update (prompt + response tokens ÷
its wall time), the peak RSS (``ru_maxrss``) before the update (model, batch, no-grad log-probs)
and after it, and the update's own rise in resident memory (a thread samples /proc/self/statm
every 5 ms; from the RSS at its start, after ``malloc_trim``): activations, logits or chunks,
gradients, AdamW state — which the earlier phases' high-water mark can hide from ``ru_maxrss``.
The subprocesses run with ``MALLOC_MMAP_THRESHOLD_`` = 1 MB (``--mmap-threshold``) so that
their RSS follows the live tensors (glibc's default keeps freed heap resident: ±400 MB noise).
Writes bench/results/lm_head.json and the ``lm_head`` table of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

SIDES = ("chunked", "full")
# glibc keeps freed heap memory below its (dynamic, up to 32 MB) mmap threshold resident, so the
# RSS of two identical runs differed by ±400 MB; with every allocation ≥ 1 MB in its own mapping,
# RSS follows the live tensors (two full-head runs: 3269 and 3271 MB of rise)
MMAP_THRESHOLD = 1 << 20


def current_rss_mb() -> float:
    """This process's resident memory now (/proc/self/statm), MB."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class RssSampler:
    """The most resident memory seen by a thread reading /proc/self/statm every ``every_s``."""

    def __init__(self, every_s: float = 0.005):
        import threading

        self.every_s, self.peak_mb, self._stop = every_s, current_rss_mb(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak_mb = max(self.peak_mb, current_rss_mb())

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mb = max(self.peak_mb, current_rss_mb())


def run_side(model_path: str, side: str, micro: int, seq: int, steps: int) -> dict:
    """One side in this process: tokens/s and update seconds; ru_maxrss before and after the
    update; and the update's own rise in resident memory (sampled peak − RSS at its start, after
    ``malloc_trim`` returned the freed heap), which earlier high-water marks cannot hide."""
    import ctypes
    import gc
    import resource

    from bench.train import synthetic_batch, train_config
    from workers.policy import PolicyWorker

    worker = PolicyWorker(train_config(model_path, micro, seq, steps, **{"actor.lm_head": side}))
    batch = synthetic_batch(worker, micro * steps, seq)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    start = current_rss_mb()
    with RssSampler() as sampler:
        m = worker.update_policy(batch, expected_version=0, batch_id="b0")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"tokens_per_s": micro * steps * seq / m["timing_s/update_actor"], "update_s": m["timing_s/update_actor"],
            "rss_before_update_mb": before, "peak_rss_mb": peak, "update_rss_rise_mb": sampler.peak_mb - start}


def measure(model_path: str, micro: int, seq: int, steps: int, repeats: int, threads: int | None,
            mmap_threshold: int = MMAP_THRESHOLD) -> dict:
    import os

    env = dict(os.environ)
    if mmap_threshold:  # glibc: allocations this large get their own mapping, unmapped on free
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    runs: dict[str, list[dict]] = {s: [] for s in SIDES}
    for r in range(repeats):
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            cmd = [sys.executable, __file__, "--side", side, "--model", model_path, "--micro", str(micro),
                   "--seq", str(seq), "--steps", str(steps)] + (["--threads", str(threads)] if threads else [])
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
            runs[side].append(json.loads(out.strip().splitlines()[-1]))
            print(side, runs[side][-1], file=sys.stderr)
    res = {"model": model_path, "micro_batch": micro, "seq": seq, "optimizer_steps": steps, "repeats": repeats,
           "malloc_mmap_threshold": mmap_threshold, "runs": runs}
    for side in SIDES:
        res[side] = {k: common.stats([x[k] for x in runs[side]])
                     for k in ("tokens_per_s", "rss_before_update_mb", "peak_rss_mb", "update_rss_rise_mb")}
    return res


def render(res: dict) -> str:
    rows = []
    for side in SIDES:
        s = res[side]
        rows.append((side, f"{s['tokens_per_s']['median']:.1f}",
                     f"{s['tokens_per_s']['min']:.1f}–{s['tokens_per_s']['max']:.1f}",
                     f"{s['rss_before_update_mb']['median']:.0f}", f"{s['peak_rss_mb']['median']:.0f}",
                     f"{s['update_rss_rise_mb']['median']:.0f}",
                     f"{s['update_rss_rise_mb']['min']:.0f}–{s['update_rss_rise_mb']['max']:.0f}"))
    return "\n\n".join([
        common.measured_under(res["environment"]) + f" Model `{res['model']}`, micro-batch {res['micro_batch']} × "
        f"{res['seq']} tokens, {res['optimizer_steps']} optimizer steps per update, {res['repeats']} alternating "
        "runs per side, one subprocess each, no warm-up; "
        + (f"MALLOC_MMAP_THRESHOLD_={res['malloc_mmap_threshold']}." if res.get("malloc_mmap_threshold")
           else "glibc's default malloc settings."),
        common.markdown_table(["actor.lm_head", "tokens/s (median)", "min–max", "peak RSS before update MB",
                               "peak RSS after update MB", "RSS rise during update MB (median)", "min–max"], rows),
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=common.DEMO_MODEL)
    p.add_argument("--micro", type=int, default=8, help="trajectories per micro-batch (= mini-batch)")
    p.add_argument("--seq", type=int, default=256, help="tokens per trajectory (prompt + response)")
    p.add_argument("--steps", type=int, default=1, help="optimizer steps per update")
    p.add_argument("--repeats", type=int, default=2, help="subprocess runs per side")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--mmap-threshold", type=int, default=MMAP_THRESHOLD,
                   help="MALLOC_MMAP_THRESHOLD_ for the subprocesses, bytes (0 = glibc's default)")
    p.add_argument("--side", choices=SIDES, default=None, help="(internal) run one side here and print its JSON")
    p.add_argument("--out", default=None)
    p.add_argument("--no-docs", action="store_true")
    args = p.parse_args(argv)
    common.set_threads(args.threads)
    if args.side:
        print(json.dumps(run_side(args.model, args.side, args.micro, args.seq, args.steps)))
        return 0
    data = measure(args.model, args.micro, args.seq, args.steps, args.repeats, args.threads, args.mmap_threshold)
    common.write_result_and_render("lm_head", data, render, out=args.out, docs=not args.no_docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
