"""Shared services for integration tests: one local Prefect server and one local Ray for the
session, both started here on 127.0.0.1 and stopped by the PID/handle we own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    from flows.runtime import start_prefect_server

    old = os.environ.get("PREFECT_API_URL")
    server = start_prefect_server(tmp_path_factory.mktemp("prefect-home"), timeout_s=180)
    os.environ["PREFECT_API_URL"] = server.url
    # Prefect reads its settings when first imported; unit tests may have imported it already in
    # this session, so apply the URL to the live settings context too.
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: server.url}):
        yield server.url
    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    finally:
        server.stop()
        if old is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = old


@pytest.fixture(scope="session")
def ray_cluster(prefect_api):
    import ray

    root = Path(__file__).resolve().parents[2]
    if not ray.is_initialized():
        os.environ.setdefault("RAY_num_workers_soft_limit", "8")  # as flows.runtime.ensure_ray does
        ray.init(
            num_cpus=3,
            include_dashboard=False,
            namespace="hybridflow-tests",
            _node_ip_address="127.0.0.1",
            runtime_env={"env_vars": {"PREFECT_API_URL": prefect_api, "TOKENIZERS_PARALLELISM": "false",
                                      "PYTHONPATH": str(root), "RAY_DEDUP_LOGS": "0"}},
        )
    yield ray


@pytest.fixture(scope="session")
def arith_files(tmp_path_factory):
    """Small generated train/val parquet files in verl format."""
    from hybridflow.data import write_rows
    from hybridflow.data.tasks import make_arith

    d = tmp_path_factory.mktemp("data")
    write_rows(make_arith(12, difficulty=0, seed=1), str(d / "train.parquet"))
    write_rows(make_arith(4, difficulty=0, seed=2), str(d / "val.parquet"))
    return str(d / "train.parquet"), str(d / "val.parquet")


def release_run_pools(run_id: str, cfg) -> None:
    """The train flow leaves its pools up; free their CPUs for the pools a test starts next."""
    from workers.pool import PoolError, destroy_pool, get_pool, namespace_for

    for name in cfg.placement.pools:
        try:
            destroy_pool(get_pool(name, namespace_for(run_id)))
        except PoolError:
            pass


def tiny_overrides(run_dir: str, train: str, val: str, **extra: str) -> list[str]:
    """A tiny-model config: 2 prompts × 2 samples, 6 response tokens; 3 logical CPUs in total."""
    base = {
        "model.path": "tiny",
        "data.train_files": f"[{train}]",
        "data.val_files": f"[{val}]",
        "data.prompts_per_iteration": "2",
        "data.max_prompt_tokens": "448",  # + the response must fit the tiny model's 512 positions
        "rollout.samples_per_prompt": "2",
        "rollout.max_response_tokens": "6",
        "actor.mini_batch_trajectories": "4",
        "actor.micro_batch_trajectories": "2",
        "actor.lr": "1e-3",
        "critic.mini_batch_trajectories": "4",
        "critic.micro_batch_trajectories": "2",
        "reward.num_workers": "1",
        "placement.pools.main.cpus_per_worker": "1",
        "placement.pools.reward.cpus_per_worker": "0.5",
        "trainer.run_dir": run_dir,
        "trainer.total_iterations": "2",
        "trainer.save_every": "1",
        "trainer.val_every": "0",
        "trainer.val_before_train": "false",
        "trainer.device": "cpu",
        "tracking.mlflow_uri": f"sqlite:///{run_dir}/mlflow.db",
        "tracking.log_model": "none",  # logging the final checkpoint as an MLflow model: test_observe.py
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]
