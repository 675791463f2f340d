"""Pool workers keep freed memory: glibc malloc settings in each actor's environment
(``placement.pools.NAME.keep_freed_memory``, default on).

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh ``mmap``
and gives it back with ``munmap`` when freed. A CPU training step allocates and frees
activations, logits chunks and gradients of that size many times, so the kernel zero-fills
their pages again on every first touch. ``MALLOC_MMAP_MAX_=0`` makes the heap serve large
allocations too, and a high ``MALLOC_TRIM_THRESHOLD_`` keeps freed heap memory in the process,
so the next step reuses pages that are already mapped. The cost: each worker keeps its peak
heap resident. glibc reads these variables when the process starts, so they go into the
actor's ``runtime_env`` (Ray starts the actor's process with them); other C libraries ignore
them. Intel's PyTorch CPU tuning guide recommends jemalloc or tcmalloc for the same reason;
this needs no extra library.

Measured (docs/benchmarks.md, e2e_grid): a forward/backward loop of two 4096-wide linears took
188k minor page faults in 3 steps without the settings, 16k with them; in the policy pool's Ray
worker at 2 × 8, ≤ 128 tokens (``bench/overhead.py``, two runs of four iterations per setting,
alternating), updates took 15.6–31.3 s (median 26.5) without them and 12.8–20.6 s (median 16.6)
with them, and without them the updates grew slower iteration after iteration.
"""

from __future__ import annotations

from typing import Any

KEEP_FREED_MEMORY_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "100000000000"}


def worker_env(pool_cfg: Any, threads: int) -> dict[str, str]:
    """The environment variables a pool's actors start with: ``OMP_NUM_THREADS`` = ``threads``,
    plus :data:`KEEP_FREED_MEMORY_ENV` when ``pool_cfg.keep_freed_memory``."""
    env = {"OMP_NUM_THREADS": str(threads)}
    if pool_cfg.keep_freed_memory:
        env |= KEEP_FREED_MEMORY_ENV
    return env


__all__ = ["KEEP_FREED_MEMORY_ENV", "worker_env"]
