"""PolicyWorker: the hybrid engine — rollout engine and trainer of the policy in one process.

The trainer's model is wrapped for data parallelism (DDP, or FSDP2 ``fully_shard``); the
rollout engine generates with an *inference module* holding the same weights:

- DDP / one rank: the trainer's own module object (the HF engine shares it; nothing to sync);
- FSDP2 with several ranks: an unsharded copy, refreshed from the gathered full weights after
  every applied update (and after a checkpoint load);
- an engine that owns its weights (vLLM): ``engine.load_weights`` of the merged HF-named weights;
  with LoRA, only the adapter (``engine.load_lora_adapter``): the engine's base weights never change.

Log-probs are recomputed on the inference module too (same weights, no collectives), on
logits / ``rollout.temperature`` as the rollout reports them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from hybridflow.algorithms import (
    get_policy_loss,
    kl_loss,
    masked_mean,
    masked_sum,
    rollout_correction_weights,
)
from hybridflow.algorithms.rollout_correction import IS_MAX, STALE_TOKEN_FRACTION, fresh_token_mask
from hybridflow.batch import Batch, BatchError, is_padding
from hybridflow.config import ExperimentConfig
from hybridflow.precision import resolved_precision
from workers import checkpoint as C
from workers import distributed as D
from workers import shared_prefix
from workers.dispatch import dispatch
from workers.generation import RANK_SEED_STRIDE, Generation  # noqa: F401 (RANK_SEED_STRIDE re-exported)
from workers.log_probs import LogprobGap, sequence_log_probs
from workers.micro_batches import chunked_inference, disable_dropout
from workers.outcome import UpdateOutcome
from workers.rollout.multi_turn import MultiTurnRollout
from workers.training import (
    MicroResult,
    Optimization,
    OptimSettings,
    VersionedUpdates,
    VersionMismatchError,
)
from workers.weight_publisher import WeightPublisher

POLICY_DIR, POLICY_OPTIM_DIR = "policy", "policy_optim"


def build_policy_module(cfg: ExperimentConfig, device: torch.device) -> nn.Module:
    """The initial policy: the configured model (seeded by trainer.seed), LoRA applied, no dropout."""
    from hybridflow.models import apply_lora, load_causal_lm

    module = apply_lora(load_causal_lm(cfg.model, device=device, seed=cfg.trainer.seed), cfg.model,
                        seed=cfg.trainer.seed)
    return disable_dropout(module)


def check_versions_agree(version: int, role: str) -> None:
    """Raise VersionMismatchError on every rank when the ranks' weights_version differ (collective)."""
    if not D.is_distributed():
        return
    mx = D.all_reduce_max(torch.tensor([version, -version], dtype=torch.float64))
    if int(mx[0]) != version or int(-mx[1]) != version:
        raise VersionMismatchError(
            f"{role} ranks disagree on weights_version (between {int(-mx[1])} and {int(mx[0])}); rebuild the pool"
        )


class PolicyWorker(Generation, WeightPublisher):
    """Policy rollout + training on one data-parallel rank (see the module docstring).

    cfg: the experiment config. rank/world_size: this rank of the policy pool; with
    world_size > 1 torch.distributed must already be initialised (the pool does it).
    device: "cpu", "cuda" or "cuda:N". namespace: the run's Ray namespace, where a multi-turn
    rollout finds the tools pool (given by the pool's WorkerHost; None: the job's).
    """

    def __init__(self, cfg: ExperimentConfig, *, rank: int = 0, world_size: int = 1, device: str = "cpu",
                 namespace: str | None = None):  # fmt: skip
        from hybridflow.models import load_tokenizer, tokenizer_stop_ids
        from workers.rollout.base import build_engine

        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.device = torch.device(device)
        self.precision = resolved_precision(cfg)  # the run's one decision (bf16-mixed: autocast forwards)
        self.strategy = D.pool_strategy(cfg, "policy")
        self.tokenizer = load_tokenizer(cfg.model)
        self.stop_ids = tokenizer_stop_ids(self.tokenizer)
        self.module = build_policy_module(cfg, self.device)
        self.model = D.wrap_for_training(self.module, self.strategy, world_size)
        self.sharded = D.is_fsdp(self.model)
        # the unsharded module generation and log-prob recomputation run on
        self.inference_module = build_policy_module(cfg, self.device) if self.sharded else self.module
        self.engine = build_engine(cfg, model=self.inference_module, tokenizer=self.tokenizer, device=self.device)
        self.optim = Optimization(self.model, self._optim_settings(), world_size=world_size, prefix="actor",
                                  group_by_prompt=shared_prefix.shares_prompts(self.model))
        self.versions = VersionedUpdates("policy", "actor")
        self.policy_loss = get_policy_loss(cfg.actor.policy_loss)
        self._gap: LogprobGap | None = None
        self._gap_before_step = 0
        self._multi_turn = (MultiTurnRollout.from_config(self.engine, self.tokenizer, cfg, namespace)
                            if cfg.rollout.is_multi_turn else None)  # fmt: skip
        self._published: dict[int, tuple[Any, int, int]] = {}  # version -> (ObjectRef, tensors, bytes)
        self._sync_rollout_weights()

    def _optim_settings(self) -> OptimSettings:
        a, cfg = self.cfg.actor, self.cfg
        steps_per_update = -(-cfg.trajectories_per_iteration // a.mini_batch_trajectories) * a.ppo_epochs
        return OptimSettings(
            lr=a.lr, weight_decay=a.weight_decay, warmup_steps=a.lr_warmup_steps, schedule=a.lr_schedule,
            total_steps=cfg.trainer.total_iterations * steps_per_update, max_grad_norm=a.max_grad_norm,
        )

    # ---- weights to the rollout engine ---------------------------------------------------------
    def _sync_rollout_weights(self) -> None:
        """Give the engine the trainer's current weights (collective under FSDP2: the inference
        module is refreshed from the gathered full weights first), by the one weights endpoint
        (:func:`workers.weights_endpoint.push_to_engine`: nothing for the hf engine, adapters only
        with LoRA on an engine that takes them, else the merged HF-named weights)."""
        if self.sharded:
            full = D.full_model_state_dict(self.model)
            C.load_weights_strict(self.inference_module, full, where="policy rollout copy")
        self._push_to_engine(self.versions.weights_version)

    # ---- dataflow steps (generate_sequences: workers.generation.Generation) ----------------------
    @dispatch("dp_scatter")
    def compute_log_probs(self, batch: Batch) -> Batch:
        """Adds ``old_log_probs`` [B, R] float32 (current weights, logits / rollout.temperature).

        meta["metrics"]: actor/entropy (token mean over response_mask), and when the batch has
        rollout_log_probs: rollout/logprob_diff_max / _mean (|rollout − recomputed| over the mask).
        """
        temp = self.cfg.rollout.temperature

        def run(chunk: Batch) -> tuple[Tensor, Tensor]:
            lp, ent = sequence_log_probs(self.inference_module, chunk, temperature=temp, with_entropy=True,
                                         lm_head=self.cfg.actor.lm_head, pack_rows=self.cfg.actor.pack_rows,
                                         precision=self.precision)
            return lp.float().cpu(), ent.float().cpu()

        parts = chunked_inference(self.inference_module, batch, self.cfg.actor.micro_batch_trajectories, run)
        out = batch.shallow_copy()
        mask = batch["response_mask"]
        old = torch.cat([p[0] for p in parts]).masked_fill(~mask, 0.0)
        out.set("old_log_probs", old)
        entropy = torch.cat([p[1] for p in parts])
        if is_padding(batch):  # a padding stand-in adds nothing to the metrics (the reductions still run)
            mask = torch.zeros_like(mask)
        tot = D.all_reduce_sum(torch.tensor([float(masked_sum(entropy, mask)), float(mask.sum())],
                                            dtype=torch.float64)).tolist()
        metrics = {"actor/entropy": tot[0] / max(tot[1], 1.0)}
        if "rollout_log_probs" in batch:
            gap = LogprobGap()
            gap.add(old, batch["rollout_log_probs"], mask)
            metrics |= gap.metrics()
        out.meta["metrics"] = {**batch.meta.get("metrics", {}), **metrics}
        return out

    @dispatch("dp_scatter")
    def update_policy(self, batch: Batch, *, expected_version: int, batch_id: str) -> UpdateOutcome:
        """Exactly-once policy update (see :class:`workers.training.VersionedUpdates`); returns the
        :class:`~workers.outcome.UpdateOutcome` (``applied``: the decision; its metrics below).

        Needs response_mask, old_log_probs, advantages (+ ref_log_probs with actor.use_kl_loss,
        + rollout_log_probs with actor.rollout_correction).
        Returns metrics with verl names, averaged over ranks: actor/pg_loss, actor/pg_clipfrac,
        actor/pg_clipfrac_lower, actor/ppo_kl, actor/entropy, actor/kl_loss, actor/grad_norm,
        actor/lr, actor/bad_updates, actor/update_skipped, perf/total_num_tokens, timing_s/update_actor;
        actor/entropy is the loss-aggregated entropy with an entropy bonus (actor.entropy_coef ≠ 0),
        else only a logged metric, measured (without gradient) on a sample: the token mean over the
        first micro-batch of each mini-batch (whose rows are the mini-batch's shortest responses,
        or its first prompt group, see workers.micro_batches.by_length);
        with a rollout correction rollout_corr/rollout_is_mean and _ratio_fraction_high (token
        means) and rollout_corr/rollout_is_max (max over micro-batches and ranks).
        Raises VersionMismatchError, or BatchError for a missing field.
        """
        check_versions_agree(self.versions.weights_version, "policy")
        return self.versions.run(expected_version, batch_id, lambda: self._update(batch))

    def _update(self, batch: Batch) -> UpdateOutcome:
        a = self.cfg.actor
        needed = ["response_mask", "old_log_probs", "advantages"] + (["ref_log_probs"] if a.use_kl_loss else [])
        missing = [k for k in needed if k not in batch]
        if missing:
            raise BatchError(f"update_policy: batch lacks {missing} (has {batch.keys()})")
        if self.cfg.rollout_correction != "none" and "rollout_log_probs" not in batch:
            raise BatchError(
                f"update_policy: actor.rollout_correction={self.cfg.rollout_correction} needs rollout_log_probs (the "
                f"behaviour policy's log-probs), which rollout.engine={self.cfg.rollout.engine} did not put in the "
                f"batch (has {batch.keys()})"
            )
        self.model.train()
        # old_log_probs from the rollout engine: measure the engine-vs-trainer gap for free on the
        # micro-batches that run before the first optimizer step (weights still those of rollout)
        measure_gap = self.cfg.old_log_probs_from_rollout and "rollout_log_probs" in batch
        self._gap = LogprobGap() if measure_gap else None
        self._gap_before_step = self.optim.steps_applied
        self._padding = is_padding(batch)  # a stand-in's zero-weight passes are not measured
        outcome = self.optim.apply(
            batch, self._micro_loss,
            mini_batch_trajectories=a.mini_batch_trajectories, micro_batch_trajectories=a.micro_batch_trajectories,
            epochs=a.ppo_epochs, loss_agg_mode=a.loss_agg_mode, max_response_tokens=self.cfg.rollout.max_response_tokens,
            shuffle_seed=self.cfg.trainer.seed + self.versions.weights_version if a.shuffle else None,
            progress=self.progress.tick("updating policy"),
        )
        metrics = dict(outcome.metrics)
        if a.use_kl_loss:
            metrics["actor/kl_coef"] = a.kl_loss_coef
        if self._gap is not None:
            metrics |= self._gap.metrics()
        tokens = 0.0 if is_padding(batch) else float(batch["response_mask"].sum() + batch["prompt_mask"].sum())
        metrics["perf/total_num_tokens"] = float(D.all_reduce_sum(torch.tensor([tokens], dtype=torch.float64)))
        metrics["perf/num_params"] = float(sum(p.numel() for p in D.unwrap(self.model).parameters()))
        metrics["perf/num_devices"] = float(self.world_size)
        if outcome.applied:
            self._sync_rollout_weights()
        return UpdateOutcome(outcome.applied, metrics)

    def _micro_loss(self, model: nn.Module, mb: Batch, plan: Any) -> MicroResult:
        a = self.cfg.actor
        # without an entropy bonus the entropy is only logged: measured on the first micro-batch of
        # each mini-batch, detached, and skipped (a pass over every chunk's logits) on the others
        bonus = a.entropy_coef != 0
        with_entropy = bonus or plan.rows.start == 0
        lp, ent = sequence_log_probs(model, mb, temperature=self.cfg.rollout.temperature, with_entropy=with_entropy,
                                     entropy_grad=bonus, lm_head=a.lm_head, pack_rows=a.pack_rows,
                                     precision=self.precision)
        dev = lp.device
        mask = mb["response_mask"].to(dev)
        if self._gap is not None and self.optim.steps_applied == self._gap_before_step and not self._padding:
            self._gap.add(lp, mb["rollout_log_probs"], mask)
        old = mb["old_log_probs"].to(dev)
        correction, corr_metrics = self._correction(old, mb, mask)
        loss, m = self.policy_loss(
            lp, old, mb["advantages"].to(dev), mask,
            clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c,
            **plan.loss_kwargs, **correction,
        )
        m = dict(m) | corr_metrics
        maxima = {k: m.pop(k) for k in [IS_MAX] if k in m}
        terms = {"pg_loss": m.pop("pg_loss")}
        if bonus:
            entropy = plan.aggregate(ent, mask)
            terms["entropy"] = float(entropy.detach())
            loss = loss - a.entropy_coef * entropy
        elif ent is not None:  # a token mean, weighted by tokens over the sampled micro-batches
            m["entropy"] = float(masked_mean(ent.detach(), mask))
        if a.use_kl_loss:
            kl = kl_loss(lp, mb["ref_log_probs"].to(dev), mask, a.kl_loss_type, **plan.loss_kwargs)
            loss = loss + a.kl_loss_coef * kl
            terms["kl_loss"] = float(kl.detach())
        return MicroResult(loss, terms, m, maxima)

    def _correction(self, old: Tensor, mb: Batch, mask: Tensor) -> tuple[dict[str, Tensor], dict[str, float]]:
        """The policy loss's ``token_weights`` option and its metrics for ``actor.rollout_correction``
        and ``actor.max_token_staleness`` ({} and {} for neither: the loss runs exactly as without a
        correction)."""
        a = self.cfg.actor
        weights, metrics = None, {}
        if self.cfg.rollout_correction != "none":
            weights, metrics = rollout_correction_weights(
                old, mb["rollout_log_probs"], mask, self.cfg.rollout_correction,
                tis_threshold=a.tis_threshold, behav_weight_cap=a.behav_weight_cap,
            )
        if a.max_token_staleness is not None and "rollout_token_versions" in mb:
            fresh, metrics[STALE_TOKEN_FRACTION] = fresh_token_mask(
                mb["rollout_token_versions"].to(mask.device), mask, self.weights_version, a.max_token_staleness)
            weights = fresh.to(old.dtype) if weights is None else weights * fresh
        return ({} if weights is None else {"token_weights": weights}), metrics

    @property
    def weights_version(self) -> int:
        return self.versions.weights_version

    # ---- versions and checkpoints --------------------------------------------------------------
    @dispatch("broadcast")
    def get_weights_version(self) -> int:
        """Updates applied so far (every rank answers; they must agree)."""
        return self.versions.weights_version

    @dispatch("broadcast")
    def save_checkpoint(self, path: str) -> None:
        """Write ``<path>/policy/`` (HF folder, rank 0; LoRA merged) and ``<path>/policy_optim/
        rank_<r>.safetensors + .json`` (optimizer state, LR step, exactly-once record, and with
        LoRA the adapter weights). Collective under FSDP2. Raises CheckpointError on I/O errors.
        """
        from hybridflow.models import save_hf_checkpoint

        root = Path(path)
        state: dict[str, Any] = {"optim": self.optim.state_dict(), "versions": self.versions.state_dict(),
                                 "world_size": self.world_size}
        if self.cfg.model.lora_rank > 0:  # merged weights cannot restore the adapters: keep them exactly
            trainable = {n for n, p in self.inference_module.named_parameters() if p.requires_grad}
            state["trainable"] = {k: v for k, v in self.inference_module.state_dict().items() if k in trainable}
        try:
            if self.rank == 0:
                save_hf_checkpoint(self.inference_module, self.tokenizer, root / POLICY_DIR)
            C.save_state(state, root / POLICY_OPTIM_DIR / f"rank_{self.rank}")
        except OSError as e:
            raise C.CheckpointError(f"policy rank {self.rank}: cannot write checkpoint to {root}: {e}") from e

    @dispatch("broadcast")
    def load_checkpoint(self, path: str) -> None:
        """Restore weights, optimizer state, LR step and weights_version written by
        :meth:`save_checkpoint` (same world size). Raises CheckpointError when files are missing."""
        root = Path(path)
        state = C.load_state(root / POLICY_OPTIM_DIR / f"rank_{self.rank}")
        if state["world_size"] != self.world_size:
            raise C.CheckpointError(f"{root}: saved by {state['world_size']} policy ranks, loading into {self.world_size}")
        plain = self.inference_module
        if self.cfg.model.lora_rank > 0:
            C.load_weights_strict(plain, {**plain.state_dict(), **state["trainable"]}, where=str(root / POLICY_DIR))
        else:
            weights = C.read_safetensors_folder(root / POLICY_DIR)
            C.load_weights_strict(plain, weights, where=str(root / POLICY_DIR))
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(self.model, plain.state_dict(), options=StateDictOptions(full_state_dict=True))
        self.optim.load_state_dict(state["optim"])
        self.versions.load_state_dict(state["versions"])
        self._push_to_engine(self.versions.weights_version)  # nothing when the engine shares the module


__all__ = ["PolicyWorker", "VersionMismatchError", "build_policy_module"]
