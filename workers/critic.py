"""CriticWorker: the PPO value model — ``compute_values`` and the exactly-once ``update_critic``.

The value model is the policy's backbone + a float32 value head (or ``critic.model_path``),
see :mod:`hybridflow.models.value`. The value of response position t is read from the hidden
state of the token before it (the state the policy acted from), as verl:
``values = V[:, P-1 : P+R-1]`` for P prompt and R response columns.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from hybridflow.algorithms import position_ids_from_mask, value_loss
from hybridflow.batch import Batch, BatchError
from hybridflow.config import ExperimentConfig
from hybridflow.precision import ResolvedPrecision, resolved_precision
from workers import checkpoint as C
from workers import distributed as D
from workers.dispatch import dispatch
from workers.micro_batches import chunked_inference, disable_dropout
from workers.outcome import UpdateOutcome
from workers.policy import check_versions_agree
from workers.progress import NO_PROGRESS, ProgressSink
from workers.shared_prefix import attention_mask
from workers.training import (
    MicroResult,
    Optimization,
    OptimSettings,
    VersionedUpdates,
)

CRITIC_DIR, CRITIC_OPTIM_DIR = "critic", "critic_optim"


def response_values(model: nn.Module, batch: Batch, precision: ResolvedPrecision | None = None) -> Tensor:
    """[B, R] float32 values of the response positions (predecessor hidden states), on the model's device.
    precision: the run's; under bf16-mixed the forward runs in autocast(bfloat16), the values and the
    loss after it in float32 (None: no autocast)."""
    device = next(model.parameters()).device
    prompt_len = batch["prompt_ids"].shape[1]
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1).to(device)
    attn = attention_mask(batch).to(device)
    pos = batch["position_ids"].to(device) if "position_ids" in batch else position_ids_from_mask(attn)
    with precision.autocast(device.type) if precision is not None else nullcontext():
        values = model(input_ids=ids, attention_mask=attn, position_ids=pos)
    return values[:, prompt_len - 1 : -1].float()


class CriticWorker:
    """Value model on one data-parallel rank of the critic's pool (DDP or FSDP2)."""

    progress: ProgressSink = NO_PROGRESS  # a pool rank gets a FileProgress (workers.host.WorkerHost)

    def __init__(self, cfg: ExperimentConfig, *, rank: int = 0, world_size: int = 1, device: str = "cpu"):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.device = torch.device(device)
        self.precision = resolved_precision(cfg)  # the run's one decision (bf16-mixed: autocast forwards)
        self.module = self._build()
        self.model = D.wrap_for_training(self.module, D.pool_strategy(cfg, "critic"), world_size)
        self.sharded = D.is_fsdp(self.model)
        c = cfg.critic
        steps = -(-cfg.trajectories_per_iteration // c.mini_batch_trajectories) * c.ppo_epochs
        settings = OptimSettings(lr=c.lr, weight_decay=0.0, warmup_steps=c.lr_warmup_steps, schedule="constant",
                                 total_steps=cfg.trainer.total_iterations * steps, max_grad_norm=c.max_grad_norm)
        self.optim = Optimization(self.model, settings, world_size=world_size, prefix="critic")
        self.versions = VersionedUpdates("critic", "critic")
        self._plain: nn.Module | None = None  # unsharded copy for saving under FSDP2

    def _build(self, critic_path: str | None = None) -> nn.Module:
        from hybridflow.models import load_value_model

        path = critic_path or self.cfg.critic.model_path
        model = load_value_model(self.cfg.model, critic_path=path, device=self.device, seed=self.cfg.trainer.seed)
        return disable_dropout(model)

    @property
    def _inference_model(self) -> nn.Module:
        return self.model if self.sharded else self.module  # DDP: the plain module (no collectives)

    @dispatch("dp_scatter")
    def compute_values(self, batch: Batch) -> Batch:
        """Adds ``values`` [B, R] float32 (0 outside response_mask)."""
        model = self._inference_model
        parts = chunked_inference(model, batch, self.cfg.critic.micro_batch_trajectories,
                                  lambda chunk: response_values(model, chunk, self.precision).cpu())
        out = batch.shallow_copy()
        out.set("values", torch.cat(parts).masked_fill(~batch["response_mask"], 0.0))
        return out

    @dispatch("dp_scatter")
    def update_critic(self, batch: Batch, *, expected_version: int, batch_id: str) -> UpdateOutcome:
        """Exactly-once clipped value-loss update (needs response_mask, values, returns); returns the
        :class:`~workers.outcome.UpdateOutcome` (``applied``: the decision; its metrics below).

        Metrics (averaged over ranks): critic/vf_loss, critic/vf_clipfrac, critic/vpred_mean,
        critic/grad_norm, critic/lr, critic/bad_updates, critic/update_skipped. Raises
        VersionMismatchError or BatchError (missing field).
        """
        check_versions_agree(self.versions.weights_version, "critic")
        return self.versions.run(expected_version, batch_id, lambda: self._update(batch))

    def _update(self, batch: Batch) -> UpdateOutcome:
        missing = [k for k in ("response_mask", "values", "returns") if k not in batch]
        if missing:
            raise BatchError(f"update_critic: batch lacks {missing} (has {batch.keys()})")
        c = self.cfg.critic
        return self.optim.apply(
            batch, self._micro_loss, mini_batch_trajectories=c.mini_batch_trajectories,
            micro_batch_trajectories=c.micro_batch_trajectories, epochs=c.ppo_epochs, loss_agg_mode=c.loss_agg_mode,
            max_response_tokens=self.cfg.rollout.max_response_tokens, progress=self.progress.tick("updating critic"),
        )

    def _micro_loss(self, model: nn.Module, mb: Batch, plan: Any) -> MicroResult:
        values = response_values(model, mb, self.precision)
        dev = values.device
        loss, m = value_loss(
            values, mb["values"].to(dev), mb["returns"].to(dev), mb["response_mask"].to(dev),
            clip_range_value=self.cfg.critic.clip_range_value, **plan.loss_kwargs,
        )
        m = dict(m)
        return MicroResult(loss, {"vf_loss": m.pop("vf_loss")}, m)

    # ---- versions and checkpoints --------------------------------------------------------------
    @dispatch("broadcast")
    def get_weights_version(self) -> int:
        return self.versions.weights_version

    def _plain_module(self) -> nn.Module:
        """The unsharded value model with the current weights (collective under FSDP2)."""
        if not self.sharded:
            return self.module
        full = D.full_model_state_dict(self.model)
        if self._plain is None:
            self._plain = self._build()
        C.load_weights_strict(self._plain, full, where="critic copy")
        return self._plain

    @dispatch("broadcast")
    def save_checkpoint(self, path: str) -> None:
        """Write ``<path>/critic/`` (backbone HF folder + value_head.safetensors, rank 0) and
        ``<path>/critic_optim/rank_<r>``. Collective under FSDP2. Raises CheckpointError on I/O errors."""
        from hybridflow.models import save_value_model

        root = Path(path)
        plain = self._plain_module()
        state = {"optim": self.optim.state_dict(), "versions": self.versions.state_dict(), "world_size": self.world_size}
        try:
            if self.rank == 0:
                save_value_model(plain, root / CRITIC_DIR)
            C.save_state(state, root / CRITIC_OPTIM_DIR / f"rank_{self.rank}")
        except OSError as e:
            raise C.CheckpointError(f"critic rank {self.rank}: cannot write checkpoint to {root}: {e}") from e

    @dispatch("broadcast")
    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote. A checkpoint without ``critic/`` is skipped
        when the config needs no critic (nothing was trained); otherwise CheckpointError."""
        root = Path(path)
        if not (root / CRITIC_DIR).is_dir():
            if self.cfg.needs_critic:
                raise C.CheckpointError(f"{root} has no {CRITIC_DIR}/ but algorithm.adv_estimator needs a critic")
            return
        state = C.load_state(root / CRITIC_OPTIM_DIR / f"rank_{self.rank}")
        if state["world_size"] != self.world_size:
            raise C.CheckpointError(f"{root}: saved by {state['world_size']} critic ranks, loading into {self.world_size}")
        weights = self._build(str(root / CRITIC_DIR)).state_dict()
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(self.model, weights, options=StateDictOptions(full_state_dict=True))
        else:
            C.load_weights_strict(self.module, weights, where=str(root / CRITIC_DIR))
        self.optim.load_state_dict(state["optim"])
        self.versions.load_state_dict(state["versions"])


__all__ = ["CriticWorker", "response_values"]
