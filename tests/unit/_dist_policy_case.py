"""Helper for test_worker_policy_distributed.py: what each spawned rank of a 2-rank policy pool runs."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from hybridflow.batch import Batch
from tests.unit._dist_case import end_rank
from tests.unit._worker_helpers import tiny_cfg
from workers import checkpoint as C
from workers import distributed as D
from workers.policy import PolicyWorker

SIZES = ["data.prompts_per_iteration=3", "actor.mini_batch_trajectories=6", "critic.mini_batch_trajectories=6"]


def cfg_for(strategy: str, *extra: str):
    return tiny_cfg(*SIZES, f"placement.pools.main.strategy={strategy}", *extra)


def critic_batch(batch: Batch) -> Batch:
    """The rollout batch with old values 0 and returns 1 on the response (a fixed critic target)."""
    out = batch.shallow_copy()
    mask = batch["response_mask"]
    out.set("values", torch.zeros(mask.shape))
    out.set("returns", mask.float())
    return out


def _critic_round(rank: int, world: int, part: Batch, ckpt: str) -> dict[str, torch.Tensor]:
    """FSDP2 critic: update on this rank's rows, then a checkpoint round trip."""
    from workers.critic import CriticWorker

    cfg = cfg_for("fsdp", "algorithm.adv_estimator=gae")
    critic = CriticWorker(cfg, rank=rank, world_size=world)
    critic.update_critic(critic_batch(part), expected_version=0, batch_id="c0")
    out = {f"critic/{k}": v for k, v in D.full_model_state_dict(critic.model).items()}
    if rank == 0:
        C.begin_save(ckpt, 1)
    D.barrier()
    critic.save_checkpoint(C.step_dir(ckpt, 1))
    D.barrier()
    if rank == 0:
        C.finalize_checkpoint(ckpt, 1, {})
    D.barrier()
    fresh = CriticWorker(cfg, rank=rank, world_size=world)
    fresh.load_checkpoint(C.load_latest(ckpt))
    return out | {f"critic_reloaded/{k}": v for k, v in D.full_model_state_dict(fresh.model).items()}


def rank_main(rank: int, world: int, port: int, batch_uri: str, out_dir: str) -> None:
    """FSDP2: update this rank's groups; rank 0 saves the gathered weights, the rollout copy (synced
    after the update) and the weights after a checkpoint round trip. (DDP equivalence of the update
    loop is shown by test_worker_distributed.py, which starts faster.)"""
    torch.set_num_threads(1)
    D.init_process_group(rank, world, master_port=port)
    # 3 groups of 2: rank 0 gets 2 groups (2 micro-batches), rank 1 one group (1 + a padding pass)
    part = Batch.load(batch_uri).split_by_groups(world)[rank]
    for strategy in ("fsdp",):
        worker = PolicyWorker(cfg_for(strategy), rank=rank, world_size=world)
        metrics = worker.update_policy(part, expected_version=0, batch_id="b0")
        out = {f"w/{k}": v for k, v in D.full_model_state_dict(worker.model).items()}
        out["metric/pg_loss"] = torch.tensor(metrics["actor/pg_loss"])
        if strategy == "fsdp":
            out |= {f"rollout/{k}": v.detach().clone() for k, v in worker.inference_module.state_dict().items()}
            ckpt = f"{out_dir}/ckpt"
            if rank == 0:
                C.begin_save(ckpt, 1)
            D.barrier()
            worker.save_checkpoint(C.step_dir(ckpt, 1))
            D.barrier()
            if rank == 0:
                C.finalize_checkpoint(ckpt, 1, {})
            D.barrier()
            fresh = PolicyWorker(cfg_for(strategy), rank=rank, world_size=world)
            fresh.load_checkpoint(C.load_latest(ckpt))
            out |= {f"reloaded/{k}": v for k, v in D.full_model_state_dict(fresh.model).items()}
            out["metric/reloaded_version"] = torch.tensor(float(fresh.get_weights_version()))
        out |= _critic_round(rank, world, part, f"{out_dir}/critic_ckpt")
        if rank == 0:
            save_file({k: v.contiguous() for k, v in out.items()}, f"{out_dir}/{strategy}.safetensors")
    end_rank()
