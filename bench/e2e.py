"""One GRPO iteration end to end: hybridflow (Prefect + Ray pools) against TRL's GRPOTrainer.

    hybridflow bench e2e [--repeats 3] [--runners ray,thread] [--prompts-per-step 8]
                         [--samples-per-prompt 4] [--max-response-tokens 64] [--mini 16] [--micro 4]
                         [--precision auto|fp32|bf16-mixed|bf16-true] [--trl-precision auto|fp32|bf16]
                         [--rollout-dtype auto|float32|bfloat16|config]
    hybridflow bench e2e --grid-from a.json,b.json,...   # one table of cells run with --out

Each side at its best precision on the machine, by one rule: hybridflow with ``model.precision``
``--precision`` (default auto: the driver's probe, :func:`hybridflow.precision_probe.decide_precision`,
picks bf16-mixed where a decoder-layer step measures >= 1.15x faster under bf16 autocast, else
fp32) and ``rollout.dtype`` ``--rollout-dtype`` (default auto: bfloat16 generation when the run
trains in bf16); TRL with ``bf16=True`` (its autocast mixed precision, float32 master weights)
where the same decision says bf16-mixed, float32 otherwise (``--trl-precision auto``; fp32 or bf16
force it). Both sides' precision, the probe's figures, the CPU model and its bf16 flags are in the
JSON and the table.

Same model (float32 weights), same prompts in the same order (chat-templated arithmetic, no shuffle),
same samples per prompt, max response tokens, temperature 1 with no top-k/top-p, mini-batch
(one optimizer step per ``--mini`` trajectories) and micro-batch (gradient accumulation), one
epoch, no KL so no reference model, lr 1e-6 constant, grad clip 1, the same rule reward.
TRL: ``use_vllm=False, bf16=<its precision>, gradient_checkpointing=False``, ``beta=0``,
``steps_per_generation = trajectories / micro`` so one generation feeds exactly one iteration's
optimizer steps. With more than one optimizer step per generation TRL computes old log-probs with
an extra forward pass; hybridflow (``actor.old_log_probs=auto`` with the hf engine) takes them
from the rollout engine, which sampled with the same weights (gap logged as
``rollout/logprob_diff_max``). ``--extra actor.old_log_probs=recompute`` makes hybridflow do the
extra pass too.

Runs alternate inside TRL's own training loop: a callback at the end of each TRL iteration runs
one hybridflow iteration per ``--runners`` entry (the Prefect task runner), so every side sees
the same machine state; the first round is a warm-up and is dropped. Tokens/s = (prompt +
response tokens) / iteration wall time; the ratio is hybridflow ÷ TRL within each round.
MFU: model FLOPs per iteration = tokens × 4 × 2N (one forward to generate, forward + backward =
3 forwards to train; N = the matmul weights a token multiplies, LM head included, attention scores
left out: < 3 % at these lengths); update MFU = tokens × 3 × 2N ÷ the update phase. Against two
peaks probed after every round (2048³ matmul, best of 2): float32, and the best precision's (the
faster of float32 and bfloat16).
Writes bench/results/e2e.json and the ``e2e`` table of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from bench.harness import HybridflowRunner, Settings, hybridflow_phases  # noqa: E402


def arith_reward(completions: list, ground_truth: list, data_source: list, **_: Any) -> list[float]:
    """TRL reward function: hybridflow's rule reward on each decoded completion."""
    from hybridflow.rewards.registry import default_compute_score

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(default_compute_score(ds, t, gt)["score"])
            for t, gt, ds in zip(texts, ground_truth, data_source, strict=True)]


def _timed_method(obj: Any, name: str, acc: dict[str, float], key: str, on_result=None) -> None:
    original = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            out = original(*args, **kwargs)
        finally:
            acc[key] += time.perf_counter() - t0
        if on_result is not None:
            on_result(out)
        return out

    setattr(obj, name, wrapper)


def trl_precision(choice: str, model: str) -> dict[str, Any]:
    """TRL's precision: ``choice`` "fp32" | "bf16" forces it; "auto" asks hybridflow's own decision
    (:func:`hybridflow.precision_probe.decide_precision` for this model with ``model.precision=auto``
    on the CPU, the probe cached per machine) so one rule decides both sides. Returns
    {"bf16": TRL's flag, "name": "bf16-mixed" | "fp32", "requested", "reason", "probe": figures or None}."""
    if choice != "auto":
        bf16 = choice == "bf16"
        return {"bf16": bf16, "name": "bf16-mixed" if bf16 else "fp32", "requested": choice,
                "reason": "set by --trl-precision", "probe": None}
    from hybridflow.config import load_config
    from hybridflow.precision_probe import decide_precision

    cfg = load_config(None, [f"model.path={model}", "model.precision=auto", "trainer.device=cpu"])
    decided = decide_precision(cfg)
    return {"bf16": decided.name == "bf16-mixed", **decided.model_dump(mode="json")}


def trl_config(s: Settings, output_dir: str, iterations: int, bf16: bool = False):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=s.micro_batch_trajectories,
        gradient_accumulation_steps=s.mini_batch_trajectories // s.micro_batch_trajectories,
        steps_per_generation=s.trajectories // s.micro_batch_trajectories, num_generations=s.samples_per_prompt,
        max_completion_length=s.max_response_tokens, temperature=1.0, top_p=1.0, top_k=0, beta=0.0,
        num_iterations=1, loss_type="dapo", learning_rate=s.lr, lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=1.0, bf16=bf16, fp16=False, use_vllm=False, gradient_checkpointing=False, use_cpu=True,
        report_to="none", save_strategy="no", logging_steps=10**6, disable_tqdm=True, shuffle_dataset=False,
        max_steps=iterations * (s.trajectories // s.mini_batch_trajectories), seed=s.seed,
        dataloader_num_workers=0,
    )


class Alternation:
    """The TRL callback that closes each TRL iteration's timing and runs the hybridflow ones."""

    def __init__(self, steps_per_iteration: int, runner: HybridflowRunner, task_runners: list[str],
                 probe_size: int = 2048):
        self.steps, self.probe_size = steps_per_iteration, probe_size
        self.runner, self.task_runners = runner, task_runners
        self.acc: dict[str, float] = defaultdict(float)
        self.rounds: list[dict[str, Any]] = []
        self.t0 = 0.0

    def record_tokens(self, out: dict) -> None:
        self.acc["tokens"] += float(out["prompt_mask"].sum() + out["completion_mask"].sum())
        self.acc["response_tokens"] += float(out["completion_mask"].sum())

    def start(self) -> None:
        self.acc.clear()
        self.t0 = time.perf_counter()

    def end_of_step(self, global_step: int) -> None:
        if global_step % self.steps:
            return
        wall = time.perf_counter() - self.t0
        a = dict(self.acc)
        rollout = a.get("rollout_total", 0.0)
        trl = {"wall_s": wall, "tokens": a.get("tokens", 0.0), "response_tokens": a.get("response_tokens", 0.0),
               "phases": {"generate": a.get("generate", 0.0), "reward": a.get("reward", 0.0),
                          "old_log_probs_and_advantages": rollout - a.get("generate", 0.0) - a.get("reward", 0.0),
                          "update": wall - rollout}}
        row: dict[str, Any] = {"trl": trl}
        for tr in self.task_runners:
            out = self.runner.iteration(tr)
            row[f"hybridflow_{tr}"] = {"wall_s": out["wall_s"], "tokens": out["tokens"],
                                       "response_tokens": out["response_tokens"],
                                       "phases": hybridflow_phases(out["metrics"], out["wall_s"])}
        from bench.peak import square_gflops

        # the peaks of this round's machine state (MFU's denominators), outside both sides' timings
        row["peaks_gflops"] = {"fp32": square_gflops(self.probe_size), "bf16": square_gflops(self.probe_size,
                                                                                              dtype="bfloat16")}
        self.rounds.append(row)
        print(f"round {len(self.rounds)}: " + ", ".join(
            f"{k} {v['wall_s']:.1f}s {v['tokens'] / v['wall_s']:.1f} tok/s" for k, v in row.items() if k != "peaks_gflops")
            + f", peaks fp32 {row['peaks_gflops']['fp32']:.0f} bf16 {row['peaks_gflops']['bf16']:.0f} GFLOP/s", flush=True)
        self.start()


def run_trl(s: Settings, rows: list[dict], iterations: int, alt: Alternation, bf16: bool = False) -> float:
    """Train TRL for ``iterations`` iterations with ``alt`` as its callback. Returns the model's
    forward FLOPs per token (2N, :func:`bench.common.model_flops_per_token`)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    model, tok = common.load_model(s.model, seed=s.seed)
    data = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"],
                               "data_source": r["data_source"]} for r in rows])

    class Callback(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            alt.start()

        def on_step_end(self, args, state, control, **kw):
            alt.end_of_step(state.global_step)

    with tempfile.TemporaryDirectory(prefix="trl-bench-") as out_dir:
        trainer = GRPOTrainer(model=model, reward_funcs=arith_reward, args=trl_config(s, out_dir, iterations, bf16),
                              train_dataset=data, processing_class=tok, callbacks=[Callback()])
        _timed_method(trainer, "_generate", alt.acc, "generate")
        _timed_method(trainer, "_calculate_rewards", alt.acc, "reward")
        _timed_method(trainer, "_generate_and_score_completions", alt.acc, "rollout_total", alt.record_tokens)
        flops = common.model_flops_per_token(model)["dense"]
        trainer.train()
    return flops


def mfu(side: dict[str, Any], peaks: dict[str, float], forward_flops: float) -> dict[str, float]:
    """One round of one side: model GFLOP/s of the iteration (4 × 2N per token) and of its update
    phase (3 × 2N per token), and MFU against the float32 peak and the best precision's peak."""
    update_s = side["phases"]["update"]
    it = 4 * forward_flops * side["tokens"] / side["wall_s"] / 1e9
    up = 3 * forward_flops * side["tokens"] / update_s / 1e9 if update_s > 0 else 0.0
    best = max(peaks["fp32"], peaks["bf16"])
    return {"iteration_gflops": it, "update_gflops": up, "iteration_mfu_vs_fp32_peak": it / peaks["fp32"],
            "iteration_mfu_vs_best_peak": it / best, "update_mfu_vs_fp32_peak": up / peaks["fp32"],
            "update_mfu_vs_best_peak": up / best}


def summarize(rounds: list[dict[str, Any]], forward_flops: float | None = None) -> dict[str, Any]:
    sides = [k for k in rounds[0] if k != "peaks_gflops"]
    out: dict[str, Any] = {"sides": {}, "ratios": {}}
    if "peaks_gflops" in rounds[0]:
        out["peaks_gflops"] = {k: common.stats([r["peaks_gflops"][k] for r in rounds]) for k in ("fp32", "bf16")}
    for side in sides:
        walls = [r[side]["wall_s"] for r in rounds]
        tps = [r[side]["tokens"] / r[side]["wall_s"] for r in rounds]
        phases = {k: common.stats([r[side]["phases"][k] for r in rounds]) for k in rounds[0][side]["phases"]}
        out["sides"][side] = {"wall_s": common.stats(walls), "tokens_per_s": common.stats(tps),
                              "response_tokens": common.stats([r[side]["response_tokens"] for r in rounds]),
                              "phases_s": phases}
        if forward_flops and "peaks_gflops" in rounds[0]:
            per_round = [mfu(r[side], r["peaks_gflops"], forward_flops) for r in rounds]
            out["sides"][side]["mfu"] = {k: common.stats([m[k] for m in per_round]) for k in per_round[0]}
    for side in sides:
        if side != "trl":
            out["ratios"][side] = common.stats([(r[side]["tokens"] / r[side]["wall_s"])
                                                / (r["trl"]["tokens"] / r["trl"]["wall_s"]) for r in rounds])
    return out


def measure(s: Settings, repeats: int, task_runners: list[str], extra: dict[str, str] | None = None,
            trl_precision_choice: str = "auto") -> dict[str, Any]:
    from hybridflow.precision_probe import cpu_description

    rows = common.arith_rows(256, seed=s.seed)
    trl_prec = trl_precision(trl_precision_choice, s.model)  # decided (probe cached) before either side starts
    runner = HybridflowRunner(s, prompts=256, extra_overrides=dict(extra or {})).start()
    try:
        hf_prec = runner.cfg.model.resolved_precision.model_dump(mode="json")
        hf_rollout_dtype = runner.cfg.rollout_dtype
        print(f"precision: hybridflow {hf_prec['name']} (rollout {hf_rollout_dtype}; {hf_prec['reason']}), "
              f"TRL {trl_prec['name']} (bf16={trl_prec['bf16']}; {trl_prec['reason']})", flush=True)
        alt = Alternation(s.trajectories // s.mini_batch_trajectories, runner, task_runners)
        forward_flops = run_trl(s, rows, repeats + 1, alt, bf16=trl_prec["bf16"])
    finally:
        runner.stop()
    rounds = alt.rounds[1:]  # the first round warms both sides up
    cpu, flags = cpu_description()
    return {"settings": vars(s) | {"trajectories": s.trajectories, "hybridflow_overrides": dict(extra or {})},
            "cpu": {"model": cpu, "bf16_flags": list(flags)},
            "precision": {"trl": trl_prec, "hybridflow": hf_prec | {"rollout_dtype": hf_rollout_dtype}},
            "forward_flops_per_token": forward_flops, "repeats": len(rounds),
            "task_runners": task_runners, "rounds": rounds, "warmup_round": alt.rounds[0],
            **summarize(rounds, forward_flops)}


def precision_line(res: dict) -> str:
    """CPU, bf16 flags and both sides' precision (empty for results from before precisions)."""
    if "precision" not in res:
        return ""
    cpu, p = res["cpu"], res["precision"]
    hf, trl = p["hybridflow"], p["trl"]
    probe = hf.get("probe") or trl.get("probe")
    probe_text = (f" Probe: matmul fp32 {probe['fp32_matmul_gflops']:.0f} / bf16 {probe['bf16_matmul_gflops']:.0f} "
                  f"GFLOP/s, layer step fp32 {probe['fp32_layer_ms']:.1f} / bf16-mixed {probe['bf16_layer_ms']:.1f} ms."
                  if probe else "")
    return (f" CPU {cpu['model']} (bf16 flags: {', '.join(cpu['bf16_flags']) or 'none'}). Precision: hybridflow "
            f"**{hf['name']}** (requested {hf['requested']}, rollout dtype {hf.get('rollout_dtype')}), TRL "
            f"**{trl['name']}** (`bf16={trl['bf16']}`, requested {trl['requested']}).{probe_text}")


def _pct(v: dict[str, Any], key: str) -> str:
    m = v.get("mfu")
    return f"{100 * m[key]['median']:.1f}" if m else "—"


def render(res: dict) -> str:
    s = res["settings"]
    head = (common.measured_under(res["environment"]) + f" Model `{s['model']}`; {s['prompts_per_step']} prompts × "
            f"{s['samples_per_prompt']} samples, ≤ {s['max_response_tokens']} new tokens, mini-batch "
            f"{s['mini_batch_trajectories']}, micro-batch {s['micro_batch_trajectories']}, {s['threads']} torch threads "
            f"on each side; {res['repeats']} alternating rounds after one warm-up round." + precision_line(res))
    rows = []
    for side, v in res["sides"].items():
        ph = {k: x["median"] for k, x in v["phases_s"].items()}
        if side == "trl":
            gen, other = ph["generate"] + ph["old_log_probs_and_advantages"], "—"
        else:
            gen, other = ph["rollout"] + ph["advantage"], f"{ph['other']:.1f}"
        ratio = res["ratios"].get(side)
        prec = res.get("precision", {}).get("trl" if side == "trl" else "hybridflow", {}).get("name", "fp32")
        rows.append((side.replace("_", " (") + (")" if "_" in side else ""), prec,
                     f"{v['tokens_per_s']['median']:.1f}", f"{v['wall_s']['median']:.1f}",
                     f"{v['response_tokens']['median']:.0f}", f"{gen:.1f}", f"{ph['reward']:.2f}", f"{ph['update']:.1f}", other,
                     f"{_pct(v, 'update_mfu_vs_best_peak')} / {_pct(v, 'update_mfu_vs_fp32_peak')}",
                     f"{_pct(v, 'iteration_mfu_vs_best_peak')} / {_pct(v, 'iteration_mfu_vs_fp32_peak')}",
                     "1" if ratio is None else f"{ratio['median']:.2f} ({ratio['min']:.2f}–{ratio['max']:.2f})"))
    table = common.markdown_table(
        ["framework (task runner)", "precision", "tokens/s", "iteration s", "response tokens",
         "rollout + old log-probs s", "reward s", "update s", "orchestration s",
         "update MFU % vs best / fp32 peak", "iteration MFU % vs best / fp32 peak",
         "÷ TRL tokens/s, median (min–max)"], rows)
    peaks = res.get("peaks_gflops")
    tail = (f"\n\nPeaks probed after each round (2048³ matmul, median): float32 {peaks['fp32']['median']:.0f}, "
            f"bfloat16 {peaks['bf16']['median']:.0f} GFLOP/s." if peaks else "")
    return head + "\n\n" + table + tail


def render_grid(results: list[dict]) -> str:
    """One row per e2e result (a cell of the grid, each measured side by side with TRL in its own run):
    the hybridflow side is its first task runner."""
    rows = []
    for res in results:
        s, env = res["settings"], res["environment"]
        side = next(k for k in res["sides"] if k != "trl")
        trl, hf = res["sides"]["trl"], res["sides"][side]
        tp, hp = ({k: x["median"] for k, x in v["phases_s"].items()} for v in (trl, hf))
        ratio = res["ratios"][side]
        other = hp["other"]
        prec = res.get("precision", {})
        rows.append((f"{s['prompts_per_step']} × {s['samples_per_prompt']}, ≤ {s['max_response_tokens']}",
                     f"{prec.get('trl', {}).get('name', 'fp32')} / {prec.get('hybridflow', {}).get('name', 'fp32')}",
                     f"{ratio['median']:.2f} ({ratio['min']:.2f}–{ratio['max']:.2f})",
                     f"{trl['wall_s']['median']:.1f} / {hf['wall_s']['median']:.1f}",
                     f"{tp['generate'] + tp['old_log_probs_and_advantages']:.1f} / {hp['rollout'] + hp['advantage']:.1f}",
                     f"{tp['update']:.1f} / {hp['update']:.1f}",
                     f"{trl['response_tokens']['median']:.0f} / {hf['response_tokens']['median']:.0f}",
                     f"{other:.1f} ({100 * other / hf['wall_s']['median']:.1f} %)",
                     f"{_pct(trl, 'update_mfu_vs_best_peak')} / {_pct(hf, 'update_mfu_vs_best_peak')}",
                     f"{_pct(trl, 'update_mfu_vs_fp32_peak')} / {_pct(hf, 'update_mfu_vs_fp32_peak')}",
                     f"{res['repeats']}", f"{env['load_avg'][0]:.1f} / {env['load_avg'][1]:.1f}",
                     env["date"][:16]))
    return common.markdown_table(
        ["prompts × samples, max tokens", "precision TRL / hf", "hybridflow ÷ TRL tokens/s, median (min–max)",
         "iteration s TRL / hf", "rollout + old log-probs s TRL / hf", "update s TRL / hf", "response tokens TRL / hf",
         "orchestration s (% of iteration)", "update MFU % vs best peak TRL / hf",
         "update MFU % vs fp32 peak TRL / hf", "rounds", "load avg 1 / 5 min at the end", "measured"], rows)


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=common.DEMO_MODEL)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument("--max-response-tokens", type=int, default=64)
    p.add_argument("--mini", type=int, default=16, help="trajectories per optimizer step")
    p.add_argument("--micro", type=int, default=4, help="trajectories per forward/backward")
    p.add_argument("--threads", type=int, default=2, help="torch threads on each side")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (after one warm-up round)")
    p.add_argument("--runners", type=_csv, default=["ray", "thread"], help="hybridflow task runners to alternate")
    p.add_argument("--extra", action="append", default=[], metavar="KEY=VALUE",
                   help="a dotted hybridflow config override (repeatable), e.g. actor.old_log_probs=recompute")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16-mixed", "bf16-true"], default="auto",
                   help="hybridflow's model.precision (auto: decided by the probe, as a run decides it)")
    p.add_argument("--rollout-dtype", choices=["auto", "float32", "bfloat16", "config"], default="auto",
                   help="hybridflow's rollout.dtype (auto: bfloat16 when training in bf16; config: the config's "
                   "default, the parameters' dtype)")
    p.add_argument("--trl-precision", choices=["auto", "fp32", "bf16"], default="auto",
                   help="TRL's precision (auto: bf16=True where hybridflow's probe decides bf16-mixed, else float32)")
    p.add_argument("--out", default=None)
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--grid-from", type=_csv, default=None, metavar="JSON,JSON,...",
                   help="measure nothing: render the e2e results in these files (one per cell, from --out) as the "
                   "e2e_grid table of docs/benchmarks.md")
    args = p.parse_args(argv)
    if args.grid_from:
        import json

        text = render_grid([json.loads(Path(f).read_text()) for f in args.grid_from])
        print(text)
        if not args.no_docs:
            common.update_docs_section("e2e_grid", text)
        return 0
    bad = [x for x in args.extra if "=" not in x]
    if bad:
        p.error(f"--extra takes KEY=VALUE, got {bad}")
    common.exit_cleanly_on_sigterm()
    common.set_threads(args.threads)
    s = Settings(model=args.model, prompts_per_step=args.prompts_per_step, samples_per_prompt=args.samples_per_prompt,
                 max_response_tokens=args.max_response_tokens, mini_batch_trajectories=args.mini,
                 micro_batch_trajectories=args.micro, threads=args.threads, precision=args.precision,
                 rollout_dtype=None if args.rollout_dtype == "config" else args.rollout_dtype)
    extra = dict(x.split("=", 1) for x in args.extra)
    common.write_result_and_render("e2e", measure(s, args.repeats, args.runners, extra, args.trl_precision), render,
                                   out=args.out, docs=not args.no_docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
