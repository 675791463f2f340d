"""Shared set-up for the worker unit tests: a tiny config and hand-made batches."""

from __future__ import annotations

import torch

from hybridflow.batch import Batch
from hybridflow.config import ExperimentConfig, load_config

BASE = [
    "model.path=tiny",
    "model.tiny_hidden_size=16",
    "model.tiny_layers=1",
    "data.prompts_per_iteration=2",
    "rollout.samples_per_prompt=2",
    "rollout.max_response_tokens=6",
    "actor.mini_batch_trajectories=4",
    "actor.micro_batch_trajectories=2",
    "actor.lr=1e-3",
    "critic.mini_batch_trajectories=4",
    "critic.micro_batch_trajectories=2",
    "critic.lr=1e-3",
    "reward.num_workers=1",
]


def tiny_cfg(*overrides: str) -> ExperimentConfig:
    return load_config(None, [*BASE, *overrides])


def prompt_batch(tokenizer, prompts: tuple[str, ...] = ("1+1=", "22+3=")) -> Batch:
    """One row per prompt, left padded, with the non-tensor fields a dataset gives."""
    enc = tokenizer(list(prompts), padding=True, return_tensors="pt")
    n = len(prompts)
    return Batch.from_dict(
        {"prompt_ids": enc.input_ids, "prompt_mask": enc.attention_mask.bool()},
        {
            "uid": [f"p{i}" for i in range(n)],
            "data_source": ["arith"] * n,
            "ground_truth": ["2", "25"][:n] + ["0"] * max(0, n - 2),
            "extra_info": [{"index": i} for i in range(n)],
            "raw_prompt": list(prompts),
        },
    )


def response_batch(tokenizer, responses: list[str], truths: list[str], width: int = 12, **non_tensors) -> Batch:
    """Right-padded responses, each ending with the EOS token (which decoding drops), with the
    non-tensor fields a reward needs (uids u0, u0, u1, ...; data_source arith) plus ``non_tensors``."""
    eos = tokenizer.eos_token_id
    rows = [tokenizer(r, add_special_tokens=False).input_ids + [eos] for r in responses]
    ids = torch.full((len(rows), width), eos, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = True
    n = len(rows)
    return Batch.from_dict(
        {"response_ids": ids, "response_mask": mask},
        {"uid": ["u0", "u0", "u1"][:n], "data_source": ["arith"] * n, "ground_truth": truths,
         "extra_info": [None] * n, **non_tensors},
    )


def with_advantages(batch: Batch, seed: int = 0) -> Batch:
    """Random advantages (fixed seed) on the response positions, 0 elsewhere."""
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(batch["response_ids"].shape, generator=g).masked_fill(~batch["response_mask"], 0.0)
    batch.set("advantages", adv)
    return batch


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}
