"""One weights endpoint for both worker kinds that hold a rollout engine: the policy (hybrid
engine) and the separate rollout pool's workers (asynchronous training, docs/async.md).

:func:`push_to_engine` is the one way weights reach an engine: nothing for an engine that shares
the inference module (the HF engine); with LoRA and an engine that takes adapters (vLLM), only
the adapter tensors (``lora_A`` / ``lora_B``, PEFT names) and config, tagged with the version — the
engine's base weights never change; otherwise the merged HF-named weights.
:class:`WeightsEndpoint` is the mixin both workers share: the weight-sync group membership
(:mod:`workers.weight_group`) and loading published weights into the inference module, then the
engine. So the policy's own engine and a rollout pool's engines get the same weights the same way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workers import checkpoint as C
from workers.rollout.capabilities import engine_capabilities, weight_push


def push_to_engine(engine: Any, module: nn.Module, *, lora: bool, version: int) -> None:
    """Give ``engine`` the weights of ``module`` (the unsharded inference module), ``version`` =
    their weights_version (names a LoRA adapter). See the module docstring for the three cases."""
    mode = weight_push(engine_capabilities(engine), lora=lora)  # what the engine declares it takes
    if mode == "none":  # the engine generates with the module itself
        return
    if mode == "lora_adapter":
        from hybridflow.models import lora_adapter_state

        tensors, peft_config = lora_adapter_state(module)
        engine.load_lora_adapter(tensors, peft_config, version)
        return
    from hybridflow.models import merged_named_tensors

    engine.wake_up()
    engine.load_weights(merged_named_tensors(module))


class WeightsEndpoint:
    """The weights side of a worker with a rollout engine (see the module docstring). The worker
    provides ``cfg``, ``device``, ``engine`` and ``inference_module``."""

    cfg: Any
    device: torch.device
    engine: Any
    inference_module: nn.Module
    _weight_group: tuple[int, Any] | None = None  # (epoch, WeightGroup) while in a weight-sync group

    def _push_to_engine(self, version: int) -> None:
        """:func:`push_to_engine` of this worker's inference module (at ``version``)."""
        push_to_engine(self.engine, self.inference_module, lora=self.cfg.model.lora_rank > 0, version=version)

    def _load_published(self, state: dict[str, torch.Tensor], *, version: int, where: str) -> None:
        """Load published weights into the inference module (with LoRA, ``state`` holds the adapter
        tensors only: the base is the initial model on both sides), then push them to the engine.
        Raises CheckpointError (``where`` named) when names or shapes do not match."""
        if self.cfg.model.lora_rank > 0:
            state = {**self.inference_module.state_dict(), **state}
        C.load_weights_strict(self.inference_module, state, where=where)
        self._push_to_engine(version)

    def _join_weight_group(self, group_rank: int, host: str, port: int, world_size: int, epoch: int) -> int:
        """Join the weight-sync group ``epoch`` as ``group_rank`` (0: the policy's rank 0; 1 … R: the
        rollout ranks); every member joins at the same time. Returns ``epoch``."""
        from workers.weight_group import WeightGroup

        self._weight_group = (epoch, WeightGroup(host, port, group_rank, world_size, self.device))
        return epoch

    def _group_epoch(self) -> int | None:
        """The epoch of the weight-sync group this worker is in (None: none, e.g. after a restart)."""
        return None if self._weight_group is None else self._weight_group[0]

    def _group(self, who: str) -> Any:
        """This worker's WeightGroup; RuntimeError naming ``who`` when it is in none."""
        if self._weight_group is None:
            raise RuntimeError(f"{who} is in no weight-sync group (init_weight_group first)")
        return self._weight_group[1]


__all__ = ["WeightsEndpoint", "push_to_engine"]
