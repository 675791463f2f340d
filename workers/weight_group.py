"""A collective group for weights from the trainer to the rollout pool (``trainer.weight_sync:
collective``; docs/async.md).

The policy's rank 0 is rank 0 of the group, the rollout pool's ranks are 1 … R. The group lives
apart from each pool's own torch.distributed world (FSDP/DDP keep the default group): it is a
``TCPStore`` on the policy's rank-0 host and a process-group backend built on it directly —
``ProcessGroupNCCL`` on CUDA (tensors stay on the GPUs), ``ProcessGroupGloo`` on CPU — the
pattern of the weight-update groups of OpenRLHF and verl (vLLM's ``stateless_init_process_group``).
A publish is one ``broadcast`` per tensor from rank 0, in the order of the tensor list the
policy announces (:meth:`workers.policy.PolicyWorker.weights_layout`); the rollout ranks receive
into fresh tensors and file them in their inbox by version.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

GROUP_TIMEOUT_S = 120.0  # forming the group, and one publish's broadcasts


class WeightGroup:
    """This process's member of the weight-sync group (see the module docstring).

    host/port: where the group meets (:func:`workers.distributed.rendezvous_store`: a file store
    on a loopback host, else a TCPStore rank 0 serves); rank: 0 for the policy, 1 … R for the rollout
    ranks; world_size: R + 1; device: where tensors are broadcast ("cuda" → NCCL, else Gloo).
    Raises RuntimeError (torch's) when the group cannot form within GROUP_TIMEOUT_S."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, device: torch.device):
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
        self.rank, self.world_size, self.device = rank, world_size, device
        from workers.distributed import rendezvous_store

        self.store = rendezvous_store(host, port, world_size, rank, timeout)
        if device.type == "cuda":
            self.group: Any = dist.ProcessGroupNCCL(self.store, rank, world_size)
        else:
            self.group = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)

    def broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Broadcast ``tensors`` (in place on the receivers) from rank 0, one after another."""
        for t in tensors:
            self.group.broadcast([t], torch.distributed.BroadcastOptions()).wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def layout_of(state: dict[str, torch.Tensor]) -> list[tuple[str, list[int], str]]:
    """``[(name, shape, dtype name)]`` of a state dict, in the order the broadcast sends them."""
    return [(k, list(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()]


def empty_like_layout(layout: list[tuple[str, list[int], str]], device: torch.device) -> dict[str, torch.Tensor]:
    """Fresh tensors to receive a broadcast of ``layout`` into."""
    return {k: torch.empty(shape, dtype=getattr(torch, dtype), device=device) for k, shape, dtype in layout}


__all__ = ["WeightGroup", "layout_of", "empty_like_layout"]
