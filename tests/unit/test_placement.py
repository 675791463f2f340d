"""Pool resources Ray would refuse or never place are config errors, found before any actor starts."""

from __future__ import annotations

import os

import pytest

from hybridflow.config import ConfigError, PoolConfig, load_config
from workers.placement import PoolResourceError, bundle_of, check_fits


def _pool(workers: int, cpus: float, gpus: float = 0.0, strategy: str = "PACK") -> PoolConfig:
    return PoolConfig(workers=workers, cpus_per_worker=cpus, gpus_per_worker=gpus, roles=["policy"],
                      placement_strategy=strategy)


TWO_NODES = [{"CPU": 2.0, "memory": 1e9}, {"CPU": 1.0, "memory": 1e9}]


def test_zero_resources_is_a_config_error_naming_the_pool():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["placement.pools.reward.cpus_per_worker=0"])
    line = str(e.value)
    assert "\n" not in line and "placement.pools.reward" in line and "both 0" in line
    load_config(None, ["placement.pools.reward.cpus_per_worker=0", "placement.pools.reward.gpus_per_worker=1"])
    # built around the validator (model_construct), the placement check still refuses it
    with pytest.raises(PoolResourceError, match="only 0 resources"):
        check_fits("reward", PoolConfig.model_construct(**{**_pool(1, 1).model_dump(), "cpus_per_worker": 0.0}),
                   TWO_NODES)


def test_bundle_leaves_out_zero_entries():
    assert bundle_of(_pool(2, 0.5)) == {"CPU": 0.5}
    assert bundle_of(_pool(1, 1, 1)) == {"CPU": 1.0, "GPU": 1.0}


@pytest.mark.parametrize(
    ("workers", "cpus", "gpus", "strategy", "fits"),
    [
        (2, 1, 0, "STRICT_SPREAD", True),   # one rank on each node
        (3, 1, 0, "STRICT_SPREAD", False),  # only two nodes
        (2, 1, 0, "STRICT_PACK", True),     # both on the 2-CPU node
        (3, 1, 0, "STRICT_PACK", False),    # no node has 3 CPUs
        (3, 1, 0, "PACK", True),            # 2 + 1 across the nodes
        (4, 1, 0, "SPREAD", False),         # 3 CPUs in all
        (6, 0.5, 0, "PACK", True),          # fractional: 4 + 2
        (1, 1, 1, "PACK", False),           # no GPU anywhere
    ],
)
def test_check_fits_by_strategy(workers, cpus, gpus, strategy, fits):
    pool = _pool(workers, cpus, gpus, strategy)
    if fits:
        check_fits("main", pool, TWO_NODES)
        return
    with pytest.raises(PoolResourceError) as e:
        check_fits("main", pool, TWO_NODES)
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith(f"pool 'main' asks for {workers} × {{CPU: {float(cpus)}, GPU: {float(gpus)}}} ({strategy})")
    assert "nodes: {CPU: 2}, {CPU: 1}" in line


def test_run_dir_takes_file_uris_and_refuses_object_stores():
    assert load_config(None, ["trainer.run_dir=file:///mnt/shared/runs"]).trainer.run_dir == "/mnt/shared/runs"
    assert load_config(None, ["trainer.run_dir=file://localhost/mnt/shared/runs"]).trainer.run_dir == "/mnt/shared/runs"
    assert load_config(None, ["trainer.run_dir=file:/mnt/shared/my%20runs"]).trainer.run_dir == "/mnt/shared/my runs"
    assert load_config(None, ["trainer.run_dir=/mnt/shared/runs"]).trainer.run_dir == "/mnt/shared/runs"
    assert load_config(None, ["trainer.run_dir=runs"]).trainer.run_dir == "runs"
    for uri in ("s3://bucket/runs", "memory://runs", "gs://bucket/runs"):
        with pytest.raises(ConfigError, match=rf"trainer.run_dir='{uri}': .*not supported"):
            load_config(None, [f"trainer.run_dir={uri}"])
    # file://runs would be host "runs", not a relative folder
    with pytest.raises(ConfigError, match=r"trainer.run_dir='file://runs': a file:// URI names a path on this machine"):
        load_config(None, ["trainer.run_dir=file://runs"])
    # found by a fresh user: file:// alone meant "/", file:relative a relative folder, s3:/x and memory:x
    # (one slash or none) a local folder, an empty value the working directory itself, ~ a folder named "~"
    assert load_config(None, ["trainer.run_dir=FILE:///mnt/runs"]).trainer.run_dir == "/mnt/runs"
    assert load_config(None, ["trainer.run_dir=~/runs"]).trainer.run_dir == os.path.expanduser("~/runs")
    for uri in ("file://", "file:///", "file:relative"):
        with pytest.raises(ConfigError, match=r"an absolute folder below /"):
            load_config(None, [f"trainer.run_dir={uri}"])
    for uri in ("s3:/bucket/x", "memory:x", "S3://bucket/x"):
        with pytest.raises(ConfigError, match=r"not supported"):
            load_config(None, [f"trainer.run_dir={uri}"])
    with pytest.raises(ConfigError, match=r"trainer.run_dir=.*empty"):
        load_config(None, ["trainer.run_dir=''"])


def test_a_pool_with_no_roles_is_a_config_error():
    with pytest.raises(ConfigError, match=r"placement.pools.tools.roles.*at least 1"):
        load_config(None, ["placement.pools.tools={workers: 1, cpus_per_worker: 0.5, roles: []}"])


def test_lost_ranks_are_the_ranks_whose_last_node_is_dead(tmp_path, monkeypatch):
    import json

    import ray

    from workers.pool_events import lost_ranks

    rows = [{"event": "started", "pool": "main", "rank": 0, "node_id": "A"},
            {"event": "started", "pool": "main", "rank": 1, "node_id": "B"},
            {"event": "started", "pool": "main", "rank": 2, "node_id": "B"},  # a rank of an older, larger pool
            {"event": "started", "pool": "main", "rank": 1, "node_id": "C"},  # rank 1 restarted on C
            {"event": "started", "pool": "reward", "rank": 0, "node_id": "B"}]
    (tmp_path / "pool_events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    nodes = [{"NodeID": "A", "Alive": True, "NodeManagerAddress": "10.0.0.1"},
             {"NodeID": "B", "Alive": False, "NodeManagerAddress": "10.0.0.2"},
             {"NodeID": "C", "Alive": False, "NodeManagerAddress": "10.0.0.3"}]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    assert lost_ranks(str(tmp_path), "main", 2) == {1: {"node_id": "C", "ip": "10.0.0.3"}}
    nodes[2]["Alive"] = True
    assert lost_ranks(str(tmp_path), "main", 2) == {}
    assert lost_ranks(str(tmp_path), "reward", 1) == {0: {"node_id": "B", "ip": "10.0.0.2"}}
