"""torch.distributed helpers for the data-parallel ranks of one pool.

- :func:`init_process_group` / :func:`find_free_port`: what the pool calls on each rank
  before it builds the workers (gloo on CPU, NCCL on CUDA).
- :func:`rendezvous_address`, :func:`rendezvous_url`, :func:`rendezvous_store`: where ranks meet.
  On a loopback host (every rank on this node: the local default) a file store in the temp
  folder, which opens no socket; torch's TCPStore listens on every interface (``::``), so it is
  used only when the ranks span nodes.
- :func:`wrap_for_training`: DDP or FSDP2 (``torch.distributed.fsdp.fully_shard``).
  Both work on CPU with gloo in torch 2.13 (FSDP2 shards each decoder layer — the classes
  in the model's ``_no_split_modules`` — and then the root).
- Collectives that are no-ops in a single process: :func:`all_reduce_sum`,
  :func:`all_reduce_max`, :func:`all_reduce_mean`, :func:`barrier`.
- :func:`no_sync`, :func:`clip_grad_norm`, :func:`full_model_state_dict`: the pieces of the
  training loop that differ between plain, DDP and FSDP2 modules.

Gradient averaging: DDP and FSDP2 both *average* gradients over ranks; the training loop
compensates by dividing each rank's loss by (global normaliser / world_size), see
:func:`hybridflow.algorithms.aggregation.accumulation_plan`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import tempfile
import zlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

Strategy = Literal["ddp", "fsdp"]


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (for the rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _store_file(port: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"hybridflow-rendezvous-{port}")


def rendezvous_address(host: str) -> tuple[str, int]:
    """(host, a port free on it a moment ago): what rank 0 hands the other ranks. On a loopback
    host the port only names the file store (:func:`rendezvous_url`); a stale file of that name,
    left by a group that died, is removed here, before any rank opens it."""
    port = find_free_port("127.0.0.1" if _is_loopback(host) else "")
    if _is_loopback(host):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_store_file(port))
    return host, port


def rendezvous_url(host: str, port: int) -> str:
    """The ``init_method`` of a group whose rank 0 gave (host, port): ``file://<tmp>/hybridflow-
    rendezvous-<port>`` on a loopback host, else ``tcp://host:port``. Issue 15 item 5: a local
    run listens on 127.0.0.1 only, and torch's TCPStore would listen on every interface."""
    return f"file://{_store_file(port)}" if _is_loopback(host) else f"tcp://{host}:{port}"


def rendezvous_store(host: str, port: int, world_size: int, rank: int, timeout: timedelta) -> dist.Store:
    """The store of :func:`rendezvous_url` as an object (for process groups built directly on
    a store): a ``FileStore`` on a loopback host, else a ``TCPStore`` that rank 0 serves."""
    if _is_loopback(host):
        store = dist.FileStore(_store_file(port), world_size)
        store.set_timeout(timeout)
        return store
    return dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)


def init_process_group(
    rank: int,
    world_size: int,
    *,
    master_port: int,
    master_addr: str = "127.0.0.1",
    device: str = "cpu",
    timeout_s: float = 600.0,
) -> None:
    """Join the pool's process group (gloo for CPU, NCCL for CUDA). No-op when world_size == 1.

    Every rank must call it with the same ``master_addr:master_port`` and ``world_size``.
    Raises RuntimeError if a group is already initialised with a different world size.
    """
    if world_size <= 1:
        return
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise RuntimeError(
                f"a process group of world size {dist.get_world_size()} is already initialised; wanted {world_size}"
            )
        return
    backend = "nccl" if str(device).startswith("cuda") else "gloo"
    dist.init_process_group(
        backend,
        init_method=rendezvous_url(master_addr, master_port),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def is_distributed() -> bool:
    """True when a process group with more than one rank is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather_rows(rows: list[Any]) -> list[Any]:
    """Every rank's ``rows`` (picklable objects), rank by rank; the rows themselves on a single rank."""
    if not is_distributed():
        return rows
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    return [r for part in gathered for r in part]


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(t: Tensor) -> Tensor:
    """Element-wise sum over ranks; returns a new tensor on ``t``'s device (a copy of ``t`` alone)."""
    if not is_distributed():
        return t.detach().clone()
    buf = t.detach().to(_collective_device()).clone()
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    return buf.to(t.device)


def all_reduce_max(t: Tensor) -> Tensor:
    """Element-wise max over ranks; a copy of ``t`` in a single process."""
    if not is_distributed():
        return t.detach().clone()
    buf = t.detach().to(_collective_device()).clone()
    dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    return buf.to(t.device)


def all_reduce_mean(metrics: dict[str, float]) -> dict[str, float]:
    """Mean of each metric over ranks (float64). Every rank must pass the same keys.

    Raises ValueError if the ranks' key sets differ (checked by comparing a hash of the sorted
    keys), since a silent mismatch would average unrelated numbers.
    """
    keys = sorted(metrics)
    if not is_distributed():
        return {k: float(metrics[k]) for k in keys}
    world = dist.get_world_size()
    key_hash = float(zlib.crc32("\x00".join(keys).encode()))
    vals = torch.tensor([float(metrics[k]) for k in keys] + [key_hash, -key_hash], dtype=torch.float64)
    mx = all_reduce_max(vals[-2:])
    if mx[0] != key_hash or mx[1] != -key_hash:
        raise ValueError(f"all_reduce_mean: ranks passed different metric keys (this rank: {keys})")
    total = all_reduce_sum(vals[:-2])
    return {k: float(v) / world for k, v in zip(keys, total.tolist(), strict=True)}


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if is_distributed():
        dist.barrier()


def _shard_unit_classes(model: nn.Module) -> tuple[type, ...]:
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    return tuple({type(m) for m in model.modules() if type(m).__name__ in names})


def wrap_for_training(model: nn.Module, strategy: Strategy, world_size: int) -> nn.Module:
    """Wrap ``model`` for data-parallel training; returns it unchanged when world_size == 1.

    ddp: ``DistributedDataParallel`` (CPU/gloo: no device ids; CUDA: the model's device).
    fsdp: FSDP2 ``fully_shard`` applied in place to every decoder layer, then to the root
    (parameters become DTensor shards); the returned object is ``model`` itself.
    Raises ValueError for an unknown strategy, RuntimeError if no process group of
    ``world_size`` ranks is initialised.
    """
    if strategy not in ("ddp", "fsdp"):
        raise ValueError(f"unknown training strategy {strategy!r}; allowed: ddp, fsdp")
    if world_size <= 1:
        return model
    if not is_distributed() or dist.get_world_size() != world_size:
        raise RuntimeError(f"wrap_for_training({strategy!r}, world_size={world_size}) needs an initialised group")
    device = next(model.parameters()).device
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)
    from torch.distributed.fsdp import fully_shard

    for unit in [m for m in model.modules() if isinstance(m, _shard_unit_classes(model))]:
        fully_shard(unit)
    fully_shard(model)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The module DDP wraps (FSDP2 modules are their own module)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def unwrapped(model: nn.Module) -> nn.Module:
    """The causal LM inside DDP (``.module``) and PEFT (``.get_base_model()``) wrappers."""
    for _ in range(4):
        if isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        elif hasattr(model, "get_base_model"):
            model = model.get_base_model()
        else:
            break
    return model


def is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def no_sync(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Accumulate gradients locally (no cross-rank reduction) inside the block when ``enabled``."""
    from torch.nn.parallel import DistributedDataParallel

    if not enabled:
        yield
    elif isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif is_fsdp(model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """Clip the global gradient norm (over all ranks' shards for FSDP2) and return it (pre-clip).

    Returns a float that is NaN/inf when any gradient is; the caller decides to skip the step.
    """
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):  # DTensor under FSDP2
        norm = norm.full_tensor()
    return float(norm)


def full_model_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Full (unsharded) CPU state dict of the unwrapped model, on every rank.

    Collective under FSDP2 (every rank must call it). Tensors are detached CPU copies.
    """
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        return {k: v.detach().cpu().clone() for k, v in sd.items()}
    return {k: v.detach().cpu().clone() for k, v in unwrap(model).state_dict().items()}


__all__ = [
    "find_free_port",
    "init_process_group",
    "rendezvous_address",
    "rendezvous_store",
    "rendezvous_url",
    "is_distributed",
    "gather_rows",
    "all_reduce_sum",
    "all_reduce_max",
    "all_reduce_mean",
    "barrier",
    "wrap_for_training",
    "unwrap",
    "is_fsdp",
    "no_sync",
    "clip_grad_norm",
    "full_model_state_dict",
    "pool_strategy",
]


def pool_strategy(cfg, role: str) -> Strategy:
    """The training strategy of the pool that hosts ``role`` (``placement.pools.*.strategy``); "ddp"
    when no pool lists the role (a worker built outside any pool, e.g. in a unit test)."""
    for pool in cfg.placement.pools.values():
        if role in pool.roles:
            return pool.strategy
    return "ddp"
