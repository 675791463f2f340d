"""Training throughput and MFU of ``PolicyWorker.update_policy`` (forward + backward + AdamW).

    hybridflow bench train [--micro 8] [--seq 256] [--steps 2] [--repeats 3] [--model PATH] [--profile]
                           [--lm-head auto|chunked|full] [--precision fp32|bf16-mixed|bf16-true|auto]

The batch: ``--steps`` × ``--micro`` trajectories of exactly ``--seq`` real tokens (a quarter
prompt, the rest response; no padding), random token ids, old_log_probs from the model itself,
random advantages; one optimizer step per micro-batch (mini = micro = ``--micro``), PPO loss,
token-mean. Alternates with a bare torch step on its own copy of the model (forward, the
same log-prob gather, a policy-gradient loss, backward, clip, AdamW) to show what the
framework's update loop costs on top.

MFU = achieved model FLOP/s ÷ measured matmul peak: float32 and bfloat16 2048³ matmuls probed
between the updates (same machine state; the headline: MFU against each), and
bench/results/peak.json's (float32) peak. ``--precision`` is the policy's ``model.precision`` (auto:
decided as a run would, by :func:`hybridflow.precision_probe.decide_precision`); the bare step
follows it (bf16-mixed: its forward under autocast; bf16-true: bfloat16 weights). Model
FLOPs = 3 × forward (backward = 2 × forward) and forward = 2·N per token (N = every weight a
token multiplies, the LM head included) + causal attention 4·layers·heads·head_dim·(seq+1)/2.
``--lm-head`` is the policy's ``actor.lm_head`` (the bare step always takes the full logits;
``hybridflow bench lm_head`` compares the two heads, with peak memory). ``--profile`` writes
the torch profiler's top ops of one update to bench/results/train_profile.txt.
Writes bench/results/train.json and the ``train`` table of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402


def train_config(model_path: str, micro: int, seq: int, steps: int, **extra: str):
    from hybridflow.config import load_config

    rows = micro * steps
    ov = {"model.path": model_path, "data.prompts_per_iteration": rows, "rollout.samples_per_prompt": 1,
          "rollout.max_response_tokens": seq - seq // 4, "actor.mini_batch_trajectories": micro,
          "actor.micro_batch_trajectories": micro, "critic.mini_batch_trajectories": micro,
          "critic.micro_batch_trajectories": micro, "actor.lr": 1e-6, "trainer.device": "cpu", **extra}
    return load_config(None, [f"{k}={v}" for k, v in ov.items()])


def synthetic_batch(worker, rows: int, seq: int, seed: int = 0):
    """``rows`` full-length trajectories with old_log_probs from ``worker`` and random advantages."""
    import torch

    from hybridflow.batch import Batch

    g = torch.Generator().manual_seed(seed)
    prompt_len = seq // 4
    vocab = worker.module.config.vocab_size
    ids = torch.randint(3, vocab, (rows, seq), generator=g)
    tensors = {
        "prompt_ids": ids[:, :prompt_len], "prompt_mask": torch.ones(rows, prompt_len, dtype=torch.bool),
        "response_ids": ids[:, prompt_len:], "response_mask": torch.ones(rows, seq - prompt_len, dtype=torch.bool),
    }
    batch = Batch.from_dict(tensors, {"uid": [str(i) for i in range(rows)]})
    batch = worker.compute_log_probs(batch)
    batch.set("advantages", torch.randn(rows, seq - prompt_len, generator=g))
    return batch


def bare_step_fn(model_path: str, batch, micro: int, lr: float = 1e-6, precision=None):
    """A minimal torch update over the same batch: per micro-batch forward, log-prob gather,
    -(ratio·A) token-mean loss, backward, clip to 1.0, AdamW step. ``precision``: a
    ResolvedPrecision (None: float32)."""
    from contextlib import nullcontext

    import torch

    from hybridflow.algorithms import log_probs_from_logits

    model, _ = common.load_model(model_path)
    if precision is not None:
        model.to(precision.torch_param_dtype())
    autocast = (lambda: precision.autocast("cpu")) if precision is not None else nullcontext
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    prompt_len = batch["prompt_ids"].shape[1]

    def step() -> None:
        for start in range(0, len(batch), micro):
            mb = batch.index(range(start, min(start + micro, len(batch))))
            ids = torch.cat([mb["prompt_ids"], mb["response_ids"]], 1)
            with autocast():
                logits = model(input_ids=ids, use_cache=False).logits[:, prompt_len - 1 : -1]
            lp = log_probs_from_logits(logits, mb["response_ids"], temperature=1.0)
            loss = -(torch.exp(lp - mb["old_log_probs"]) * mb["advantages"]).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

    return step


def train_flops(model, seq: int) -> float:
    """Model FLOPs per trained token (see the module docstring)."""
    f = common.model_flops_per_token(model)
    return 3.0 * (f["dense"] + f["attn_per_ctx"] * (seq + 1) / 2)


def profile_update(worker, batch, path: Path, version: int) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        worker.update_policy(batch, expected_version=version, batch_id=f"profile-{version}")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    path.write_text(table)
    print(table)
    return version + 1


def measure(model_path: str, micro: int, seq: int, steps: int, repeats: int, profile: bool,
            probe_size: int = 2048, warmup: bool = True, lm_head: str = "auto", precision: str = "fp32") -> dict:
    from bench.peak import load_peak
    from hybridflow.precision import with_resolved_precision
    from hybridflow.precision_probe import cpu_description, decide_precision
    from workers.policy import PolicyWorker

    cfg = train_config(model_path, micro, seq, steps, **{"actor.lm_head": lm_head, "model.precision": precision})
    cfg = with_resolved_precision(cfg, decide_precision(cfg))
    worker = PolicyWorker(cfg)
    batch = synthetic_batch(worker, micro * steps, seq)
    bare = bare_step_fn(model_path, batch, micro, precision=worker.precision)
    tokens = micro * steps * seq
    state = {"version": 0}

    def hybridflow_update() -> float:
        v = state["version"]
        m = worker.update_policy(batch, expected_version=v, batch_id=f"b{v}")
        state["version"] = v + 1
        return tokens / m["timing_s/update_actor"]

    def bare_update() -> float:
        return tokens / common.timed(bare)[0]

    from bench.peak import square_gflops

    # the matmul peak is probed between the updates, so MFU is against the same machine state
    runs = {"hybridflow": hybridflow_update, "bare": bare_update, "peak_probe": lambda: square_gflops(probe_size),
            "bf16_peak_probe": lambda: square_gflops(probe_size, dtype="bfloat16")}
    got = common.alternate(runs, repeats, warmup=warmup)
    if profile:
        state["version"] = profile_update(worker, batch, common.RESULTS_DIR / "train_profile.txt", state["version"])
    flops = train_flops(worker.module, seq)
    peak = load_peak()
    out = {"model": model_path, "lm_head": lm_head, "warmup": warmup, "micro_batch": micro, "seq": seq,
           "optimizer_steps": steps, "repeats": repeats,
           "tokens_per_update": tokens, "train_flops_per_token": flops,
           "hybridflow_tokens_per_s": got["hybridflow"], "bare_tokens_per_s": got["bare"],
           "hybridflow": common.stats(got["hybridflow"]), "bare": common.stats(got["bare"]),
           "ratio": common.stats([h / b for h, b in zip(got["hybridflow"], got["bare"], strict=True)])}
    probe, bf16_probe = common.stats(got["peak_probe"]), common.stats(got["bf16_peak_probe"])
    out["peak_alongside_gflops"], out["bf16_peak_alongside_gflops"], out["probe_size"] = probe, bf16_probe, probe_size
    cpu, flags = cpu_description()
    out["precision"], out["cpu"] = worker.precision.model_dump(mode="json"), {"model": cpu, "bf16_flags": list(flags)}
    for side in ("hybridflow", "bare"):
        out[side]["mfu_vs_peak_alongside"] = out[side]["median"] * flops / 1e9 / probe["median"]
        out[side]["mfu_vs_bf16_peak_alongside"] = out[side]["median"] * flops / 1e9 / bf16_probe["median"]
    if peak:
        for side in ("hybridflow", "bare"):
            achieved = out[side]["median"] * flops / 1e9
            out[side]["gflops"] = achieved
            out[side]["mfu_vs_peak"] = achieved / peak["peak_gflops"]
            out[side]["mfu_vs_model_mix"] = achieved / peak["model_mix_gflops"]
        out["peak_used"] = {"peak_gflops": peak["peak_gflops"], "model_mix_gflops": peak["model_mix_gflops"],
                            "measured": peak["environment"]["date"]}
    return out


def render(res: dict) -> str:
    rows = []
    for side in ("hybridflow", "bare"):
        s = res[side]

        def pct(key: str, s=s) -> str:
            return f"{100 * s[key]:.1f}%" if key in s else "— (no peak.json)"

        gflops = s["median"] * res["train_flops_per_token"] / 1e9
        rows.append(("update_policy" if side == "hybridflow" else "bare torch step", f"{s['median']:.1f}",
                     f"{s['min']:.1f}–{s['max']:.1f}", f"{gflops:.1f}", pct("mfu_vs_peak_alongside"),
                     pct("mfu_vs_bf16_peak_alongside"), pct("mfu_vs_peak"), pct("mfu_vs_model_mix")))
    r = res["ratio"]
    return "\n\n".join([
        common.measured_under(res["environment"]) + f" CPU {res.get('cpu', {}).get('model', '?')} "
        f"(bf16 flags: {', '.join(res.get('cpu', {}).get('bf16_flags', [])) or 'none'}). "
        f"Precision {res.get('precision', {}).get('name', 'fp32')} ({res.get('precision', {}).get('reason', '')}). "
        f"Model `{res['model']}` (actor.lm_head={res.get('lm_head', 'full')}), micro-batch {res['micro_batch']} × "
        f"{res['seq']} tokens, {res['optimizer_steps']} optimizer steps per update, {res['repeats']} alternating runs"
        f"{'' if res.get('warmup', True) else ' (no warm-up run)'}.",
        common.markdown_table(["update", "tokens/s (median)", "min–max", "model GFLOP/s",
                               "MFU vs fp32 peak alongside", "MFU vs bf16 peak alongside", "MFU vs peak.json",
                               "MFU vs peak.json model mix"], rows),
        f"Peaks probed between the updates ({res.get('probe_size', 2048)}³ matmul, best of 2): float32 median "
        f"{res['peak_alongside_gflops']['median']:.1f} GFLOP/s (min {res['peak_alongside_gflops']['min']:.1f}, "
        f"max {res['peak_alongside_gflops']['max']:.1f})" + (
            f"; bfloat16 median {res['bf16_peak_alongside_gflops']['median']:.1f} GFLOP/s "
            f"(min {res['bf16_peak_alongside_gflops']['min']:.1f}, max {res['bf16_peak_alongside_gflops']['max']:.1f})."
            if "bf16_peak_alongside_gflops" in res else "."),
        f"update_policy / bare step: median {r['median']:.3f} (min {r['min']:.3f}, max {r['max']:.3f}). "
        f"Model FLOPs per trained token: {res['train_flops_per_token'] / 1e9:.3f} GFLOP.",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=common.DEMO_MODEL)
    p.add_argument("--micro", type=int, default=8, help="trajectories per micro-batch (= mini-batch)")
    p.add_argument("--seq", type=int, default=256, help="tokens per trajectory (prompt + response)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per update")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--profile", action="store_true", help="torch-profile one extra update")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed first update of each side")
    p.add_argument("--probe-size", type=int, default=2048, help="size of the square matmul peak probe")
    p.add_argument("--lm-head", choices=["auto", "chunked", "full"], default="auto",
                   help="the policy's actor.lm_head (bench/lm_head.py compares them)")
    p.add_argument("--precision", choices=["fp32", "bf16-mixed", "bf16-true", "auto"], default="fp32",
                   help="the policy's model.precision (the bare step follows it)")
    p.add_argument("--out", default=None)
    p.add_argument("--no-docs", action="store_true")
    args = p.parse_args(argv)
    common.set_threads(args.threads)
    data = measure(args.model, args.micro, args.seq, args.steps, args.repeats, args.profile, args.probe_size,
                   not args.no_warmup, args.lm_head, args.precision)
    common.write_result_and_render("train", data, render, out=args.out, docs=not args.no_docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
