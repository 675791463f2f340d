"""JudgeWorker: the ``judge`` role — a frozen generative model that scores trajectories by a rubric
(``reward.judge``, docs/rewards.md "Judged rewards"; LLM-as-judge, Zheng et al. 2023; verl's GenRM).

Each rank loads its own copy of the judge model once (``reward.judge.path``, else ``model.path``:
the initial policy, never the trained weights) and generates with ``reward.judge.engine``: the hf
rollout engine (:mod:`workers.rollout.hf`) on a frozen torch module, or vLLM (:mod:`workers.rollout.vllm`,
:func:`vllm_judge_engine`; the judge pool then runs on the vLLM runtime). For every trajectory the rubric
is rendered with the row's prompt, response and ground truth (:func:`hybridflow.rewards.judge.render_rubric`),
sent as one user turn of the judge's chat template, and the verdict is parsed into a score in
[0, 1] (:func:`hybridflow.rewards.judge.judge_score`). A row whose judge prompt leaves no room
for ``max_new_tokens`` in the judge's context is not generated ("overlong"); a verdict that parses
to nothing or out of range is "unparsed". Both get no score here: the reward worker scores them
``reward.on_error``, and they are counted (``reward/judge_overlong``, ``reward/judge_unparsed``),
never as reward failures (they do not stop the run).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hybridflow.batch import Batch, BatchError, is_padding
from hybridflow.config import ExperimentConfig
from workers import distributed as D
from workers.dispatch import dispatch
from workers.generation import RANK_SEED_STRIDE
from workers.reward import response_texts, row_prompts

JUDGE_FIELDS = ("judge_score", "judge_failure", "judge_verdict")


class JudgeWorker:
    """The judge on one rank of the judge pool (see the module docstring). Plain class: the pool makes
    it remote; a unit test builds it directly.

    cfg: the experiment config (``reward.judge``, and ``model`` for the default judge and the policy
    tokenizer that decodes responses); rank/world_size: this rank; device: "cpu" / "cuda"."""

    def __init__(self, cfg: ExperimentConfig, *, rank: int = 0, world_size: int = 1, device: str = "cpu"):
        from hybridflow.models import load_causal_lm, load_tokenizer, tokenizer_stop_ids
        from hybridflow.models.loading import context_length
        from workers.rollout.base import get_rollout_engine

        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.judge_cfg = cfg.reward.judge
        self.device = torch.device(device)
        model_cfg = cfg.judge_model
        self.policy_tokenizer = load_tokenizer(cfg.model)  # decodes the policy's response ids
        self.tokenizer = load_tokenizer(model_cfg)
        self.stop_ids = tokenizer_stop_ids(self.tokenizer)
        self.context = context_length(model_cfg)  # None: the model's config names no context length
        self.module = None
        if self.judge_cfg.engine == "vllm":  # vLLM loads its own copy of the judge from its folder
            self.engine = vllm_judge_engine(cfg, self.tokenizer, self.context, device)
            self.context = self.engine.max_model_len
            return
        module = load_causal_lm(model_cfg, device=self.device, seed=cfg.trainer.seed)
        module.requires_grad_(False)
        self.module = module.eval()
        rollout_cfg = cfg.rollout.model_copy(update={
            "generation_batch_trajectories": self.judge_cfg.micro_batch_trajectories,
            "dtype": None, "max_model_len": None, "compile": False})  # fmt: skip
        self.engine = get_rollout_engine("hf").from_config(
            model=self.module,
            tokenizer=self.tokenizer,
            model_cfg=model_cfg,
            rollout_cfg=rollout_cfg,
            device=device,
        )

    def _prompt_rows(self, batch: Batch) -> list[list[int]]:
        """Each row's judge input ids: the rubric rendered with its prompt (chat messages as their
        contents), response and ground truth, in the judge's chat template, + ``verdict_prefix``."""
        from hybridflow.models.reward_model import prompt_text
        from hybridflow.rewards.judge import judge_prompt_ids, render_rubric

        missing = [k for k in ("response_ids", "response_mask") if k not in batch]
        if missing:
            raise BatchError(f"judge_responses: batch lacks {missing} (has {batch.keys()})")
        n = len(batch)
        prompts = [prompt_text(p) for p in row_prompts(self.policy_tokenizer, batch)]
        truths = batch.non_tensors.get("ground_truth") or [None] * n
        responses = response_texts(self.policy_tokenizer, batch)
        j = self.judge_cfg
        return [judge_prompt_ids(self.tokenizer, render_rubric(j.rubric, p, r, t),
                                 apply_chat_template=j.apply_chat_template, prefix=j.verdict_prefix)
                for p, r, t in zip(prompts, responses, truths, strict=True)]  # fmt: skip

    def fits(self, prompt_tokens: int) -> bool:
        """Whether a judge prompt of ``prompt_tokens`` leaves ``max_new_tokens`` in the judge's context."""
        return self.context is None or prompt_tokens + self.judge_cfg.max_new_tokens <= self.context

    def _generate(self, rows: list[list[int]], seed: int) -> tuple[list[str], list[int], float]:
        """The verdicts of ``rows`` (judge ids, unpadded): their text (special tokens dropped), their
        lengths in tokens, and the engine's wall seconds."""
        from hybridflow.models.reward_model import pad_rows
        from workers.rollout.base import SamplingParams

        if not rows:
            return [], [], 0.0
        ids, mask = pad_rows(rows, int(self.tokenizer.pad_token_id), "left")
        sampling = SamplingParams(
            max_new_tokens=self.judge_cfg.max_new_tokens,
            temperature=self.judge_cfg.temperature,
            stop_token_ids=tuple(self.stop_ids),
            n=1,
            seed=seed,
        )
        start = time.perf_counter()
        out = self.engine.generate(ids.to(self.device), mask.to(self.device), sampling)
        seconds = time.perf_counter() - start
        resp, resp_mask = out.response_ids.cpu(), out.response_mask.cpu()
        texts = self.tokenizer.batch_decode(
            [resp[i][resp_mask[i]].tolist() for i in range(len(rows))], skip_special_tokens=True
        )
        return texts, resp_mask.sum(-1).tolist(), seconds

    @dispatch("dp_scatter")
    def judge_responses(self, batch: Batch, *, seed: int) -> Batch:
        """Adds non-tensors ``judge_score`` (float in [0, 1] = N / max_score, or None), ``judge_failure``
        (None | "unparsed" | "overlong") and ``judge_verdict`` (``reward.judge.verdict_prefix``
        + the judge's text; "" when not generated).

        Input: response_ids/response_mask (decoded with the policy tokenizer), raw_chat / raw_prompt
        (else prompt_ids), ground_truth when the rubric uses it. Rows over the judge's context are not
        generated. ``seed``: the sampling seed when ``reward.judge.temperature`` > 0 (rank r uses
        seed + r·1000003). meta["metrics"] over all ranks: judge/tokens_per_s (judge prompt + verdict
        tokens per second of generation), judge/verdict_tokens_per_s, judge/prompt_tokens/mean,
        judge/verdict_tokens/mean, judge/score/mean (scored rows), reward/judge_unparsed and
        reward/judge_overlong (row counts); meta["logs"]: one line when rows failed.
        Raises BatchError for missing fields."""
        from hybridflow.rewards.judge import judge_score

        rows = self._prompt_rows(batch)
        todo = [i for i, r in enumerate(rows) if self.fits(len(r))]
        texts, lengths, seconds = self._generate([rows[i] for i in todo], seed + RANK_SEED_STRIDE * self.rank)
        n = len(batch)
        verdicts, verdict_tokens = [""] * n, [0] * n
        for i, text, length in zip(todo, texts, lengths, strict=True):
            verdicts[i], verdict_tokens[i] = self.judge_cfg.verdict_prefix + text, int(length)
        generated = set(todo)
        scores = [judge_score(v, self.judge_cfg.verdict, self.judge_cfg.max_score) if i in generated else None
                  for i, v in enumerate(verdicts)]  # fmt: skip
        failures = [None if s is not None else "unparsed" if i in generated else "overlong"
                    for i, s in enumerate(scores)]  # fmt: skip
        out = batch.shallow_copy()
        for key, values in zip(JUDGE_FIELDS, (scores, failures, verdicts), strict=True):
            out.set(key, values)
        counted = not is_padding(batch)
        per_row = [
            (len(r), t, s, f) for r, t, s, f in zip(rows, verdict_tokens, scores, failures, strict=True)
        ]
        out.meta["metrics"] = {**batch.meta.get("metrics", {}), **_metrics(per_row, seconds, counted)}
        out.meta["logs"] = _failure_lines(failures, verdicts) if counted else []
        return out


def vllm_judge_engine(cfg: ExperimentConfig, tokenizer: Any, context: int | None, device: str) -> Any:
    """The judge's vLLM engine (``reward.judge.engine: vllm``), built as the rollout's
    (:meth:`workers.rollout.vllm.VLLMRolloutEngine.from_config`) on ``cfg.judge_model``'s HF folder (a
    GGUF's cached safetensors copy; "tiny": the random model of seed ``trainer.seed``, the initial
    policy), in the run's parameter dtype as the hf judge, ``max_model_len`` = the judge's context
    (``context``; None: vLLM reads the model's). Of the rollout's engine settings it keeps
    ``enforce_eager`` and ``gpu_memory_utilization``; one process (no tensor parallelism), KV cache
    ``reward.judge.kv_cache_gib`` (else ``rollout.kv_cache_gib``), at most
    ``reward.judge.micro_batch_trajectories`` sequences per step, no ``rollout.engine_kwargs`` (the
    policy's), no LoRA (``judge_model`` has none)."""
    from hybridflow.precision import model_precision
    from workers.rollout.base import get_rollout_engine

    judge, model_cfg = cfg.reward.judge, cfg.judge_model
    rollout_cfg = cfg.rollout.model_copy(update={
        "engine": "vllm", "tensor_parallel_size": 1, "kv_cache_gib": judge.kv_cache_gib or cfg.rollout.kv_cache_gib,
        "max_num_seqs": judge.micro_batch_trajectories, "max_num_batched_tokens": None,
        "enable_prefix_caching": None, "engine_kwargs": {}, "dtype": None, "max_model_len": None})  # fmt: skip
    return get_rollout_engine("vllm").from_config(
        tokenizer=tokenizer, model_cfg=model_cfg, rollout_cfg=rollout_cfg, device=device, max_model_len=context,
        seed=cfg.trainer.seed, dtype=model_precision(model_cfg).param_dtype, model_seed=cfg.trainer.seed)


def _metrics(
    per_row: list[tuple[int, int, float | None, str | None]], seconds: float, counted: bool
) -> dict[str, float]:
    """The judge's metrics over every rank's rows ``(prompt tokens, verdict tokens, score, failure)``;
    throughput = generated tokens of all ranks / the slowest rank's generation seconds."""
    rows = D.gather_rows(per_row if counted else [])
    slowest = max(D.gather_rows([seconds]))
    gen = [r for r in rows if r[3] != "overlong"]
    scored = [r[2] for r in rows if r[2] is not None]
    prompt_tokens, verdict_tokens = sum(r[0] for r in gen), sum(r[1] for r in gen)
    metrics = {
        "reward/judge_unparsed": float(sum(r[3] == "unparsed" for r in rows)),
        "reward/judge_overlong": float(sum(r[3] == "overlong" for r in rows)),
    }
    if gen:
        metrics["judge/prompt_tokens/mean"] = prompt_tokens / len(gen)
        metrics["judge/verdict_tokens/mean"] = verdict_tokens / len(gen)
    if gen and slowest > 0:
        metrics["judge/tokens_per_s"] = (prompt_tokens + verdict_tokens) / slowest
        metrics["judge/verdict_tokens_per_s"] = verdict_tokens / slowest
    if scored:
        metrics["judge/score/mean"] = sum(scored) / len(scored)
    return metrics


def _failure_lines(failures: list[str | None], verdicts: list[str]) -> list[str]:
    """One line naming this rank's failed judge rows and the first unparsed verdict (cut to 80 characters)."""
    unparsed = [v for f, v in zip(failures, verdicts, strict=True) if f == "unparsed"]
    overlong = sum(f == "overlong" for f in failures)
    if not unparsed and not overlong:
        return []
    example = f" (first verdict: {unparsed[0][:80]!r})" if unparsed else ""
    return [
        f"judge: {len(unparsed)} of {len(failures)} verdicts unparsed{example}, {overlong} over the judge's "
        "context; scored reward.on_error"
    ]


__all__ = ["JudgeWorker", "JUDGE_FIELDS", "vllm_judge_engine"]
