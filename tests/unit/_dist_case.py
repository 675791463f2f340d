"""Helper for test_worker_distributed.py: the code each spawned rank runs.

Kept free of transformers (a slow import) so spawned processes start quickly: the model is
a small pure-torch causal LM with decoder blocks that FSDP2 shards one by one.
"""

from __future__ import annotations

import os
import sys

import torch
from safetensors.torch import save_file
from torch import nn

from hybridflow.algorithms.logits import log_probs_from_logits
from hybridflow.batch import Batch
from workers import distributed as D
from workers.training import MicroResult, Optimization, OptimSettings

VOCAB = 16
SETTINGS = OptimSettings(lr=1e-2, weight_decay=0.0, warmup_steps=0, schedule="constant", total_steps=1,
                         max_grad_norm=1e9)


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mix = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        causal_mean = h.cumsum(1) / torch.arange(1, h.shape[1] + 1).view(1, -1, 1)
        return h + torch.tanh(self.mix(self.norm(causal_mean)))


class TinyLM(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self, width: int = 16, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def build_model() -> TinyLM:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return TinyLM()


def make_batch() -> Batch:
    """10 trajectories, 5 groups of 2; uneven response lengths so rows weigh differently."""
    g = torch.Generator().manual_seed(0)
    rows, prompt_len, resp_len = 10, 3, 5
    lengths = torch.tensor([5, 1, 3, 4, 2, 5, 5, 1, 2, 3])
    return Batch.from_dict(
        {
            "prompt_ids": torch.randint(3, VOCAB, (rows, prompt_len), generator=g),
            "prompt_mask": torch.ones(rows, prompt_len, dtype=torch.bool),
            "response_ids": torch.randint(3, VOCAB, (rows, resp_len), generator=g),
            "response_mask": torch.arange(resp_len).expand(rows, resp_len) < lengths.unsqueeze(1),
            "advantages": torch.randn(rows, resp_len, generator=g),
        },
        {"uid": [f"g{i // 2}" for i in range(rows)]},
    )


def loss_fn(model, mb: Batch, plan) -> MicroResult:
    """−A·log π per token, aggregated with the mini-batch's global normaliser."""
    ids = torch.cat([mb["prompt_ids"], mb["response_ids"]], 1)
    p = mb["prompt_ids"].shape[1]
    lp = log_probs_from_logits(model(ids)[:, p - 1 : -1], mb["response_ids"])
    loss = plan.aggregate(-mb["advantages"] * lp, mb["response_mask"])
    # a maximum: the largest −A of the micro-batch (in this batch it is on rank 1's part)
    neg_adv_max = float((-mb["advantages"])[mb["response_mask"]].max())
    return MicroResult(loss, {"pg_loss": float(loss.detach())}, {"rows": float(len(mb))},
                       {"neg_adv_max": neg_adv_max})


def run_update(model, batch: Batch, world_size: int) -> dict[str, float]:
    """One mini-batch of all 10 rows, micro-batches of 2, two epochs (two optimizer steps)."""
    opt = Optimization(model, SETTINGS, world_size=world_size)
    return opt.update(batch, loss_fn, mini_batch_trajectories=10, micro_batch_trajectories=2, epochs=2,
                      loss_agg_mode="token-mean", max_response_tokens=5)


def rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    """Each rank: for ddp then fsdp, update its share of the batch; rank 0 saves weights + metrics."""
    torch.set_num_threads(1)
    D.init_process_group(rank, world, master_port=port)
    # rank 0: 3 groups (6 rows → 3 micro-batches), rank 1: 2 groups (4 rows → 2 + 1 padding pass)
    part = make_batch().split_by_groups(world)[rank]
    for strategy in ("ddp", "fsdp"):
        model = D.wrap_for_training(build_model(), strategy, world)
        metrics = run_update(model, part, world)
        state = D.full_model_state_dict(model)
        if rank == 0:
            save_file(state, f"{out_dir}/{strategy}_weights.safetensors")
            save_file({k: torch.tensor(v) for k, v in metrics.items()}, f"{out_dir}/{strategy}_metrics.safetensors")
    end_rank()


def end_rank() -> None:
    """Leave the group and end the spawned rank without interpreter finalisation.

    After ``destroy_process_group`` has returned, a gloo rank still aborts about one exit in
    seven on torch 2.13 CPU (``terminate called without an active exception``, SIGABRT with no
    Python frame: a C++ thread destroyed while joinable during static destruction), which
    ``mp.spawn`` reports as a failed rank. Everything the test checks is saved by then, so the
    rank flushes its streams and leaves with ``os._exit(0)``, skipping the C++ static destructors.
    """
    D.barrier()
    D.dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
