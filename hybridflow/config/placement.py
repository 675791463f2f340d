"""``placement``: the Ray actor pools and where their roles run."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from hybridflow.config.base import (
    Role,
    _Section,
)


class PoolConfig(_Section):
    workers: int = Field(1, gt=0, description="Ray actors (data-parallel ranks) in this pool.")
    cpus_per_worker: float = Field(1.0, ge=0, description="Logical CPUs each actor reserves.")
    gpus_per_worker: float = Field(0.0, ge=0, description="GPUs each actor reserves.")
    roles: list[Role] = Field(min_length=1, description="Roles sharing each actor's process (the hybrid engine).")
    strategy: Literal["ddp", "fsdp"] = Field("ddp", description="Training strategy inside the pool.")
    torch_threads: int | None = Field(
        None, gt=0, description="torch intra-op threads per actor; None = cpus_per_worker rounded (min 1)."
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement-group strategy."
    )
    keep_freed_memory: bool = Field(
        True, description="Start each actor with glibc malloc settings that keep freed memory instead of unmapping "
        "large blocks and page-faulting them back in (MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_; "
        "workers/allocator.py): the policy update at 2x8<=128 took a median 16.6 s instead of 26.5 s on a 2-core "
        "CPU. Each actor keeps its peak heap resident. Ignored by C libraries other than glibc.",
    )

    # ---- resources Ray accepts (issue 19) ----
    @model_validator(mode="after")
    def _check_resources(self) -> PoolConfig:
        if self.cpus_per_worker == 0 and self.gpus_per_worker == 0:
            raise ValueError("cpus_per_worker and gpus_per_worker are both 0, and Ray refuses a placement-group "
                             "bundle with only 0 resources; reserve some, e.g. cpus_per_worker: 0.25")
        return self


def _default_pools() -> dict[str, PoolConfig]:
    return {
        "main": PoolConfig(workers=1, cpus_per_worker=1.0, roles=["policy", "reference", "critic"]),
        "reward": PoolConfig(workers=1, cpus_per_worker=0.5, roles=["reward"]),
    }


class PlacementConfig(_Section):
    pools: dict[str, PoolConfig] = Field(default_factory=_default_pools, description="Named Ray actor pools.")
    ray_address: str | None = Field(None, description="Ray cluster address ('auto' joins one); None starts local Ray.")
    keep_pools: bool = Field(
        False, description="Keep the pools alive after the train flow ends (a cluster serving several runs)."
    )
    retry_wait_s: float = Field(
        60.0, ge=0, description="Seconds a retried node first waits for every pool's ranks to answer, ready "
        "(a rank whose actor died is restarted by Ray and restores the latest checkpoint), so a retry never "
        "meets a rank still down and one actor kill never spends all of a node's retries (issue 40). "
        "A pool not back by then fails the retry, naming the pool.",
    )
    ray_num_cpus: float | None = Field(
        None, gt=0, description="Logical CPUs of a local Ray (None = detected cores)."
    )
