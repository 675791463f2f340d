"""``runs/<id>/pool_events.jsonl``: one line per (re)start and stop of a pool rank.

``started``: pool, rank, pid, node_id (the Ray node it runs on), cwd, restored_from (the
checkpoint it restored, or null), t. ``stopped`` (written when the pool is shut down): the same
plus ``weights_sha256`` ({role: digest of its full weights}), so a run shows where each rank ran,
what it restored and whether data-parallel ranks ended in step — records that survive the actors
(a Ray restart is otherwise visible only to whoever held the old handle).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from hybridflow.jsonl import append_line
from hybridflow.layout import POOL_EVENTS
from workers.placement import node_id


def pool_events_path(run_dir: str) -> str:
    return os.path.join(run_dir, POOL_EVENTS)


def append_event(ckpt_root: str, fields: dict[str, Any]) -> None:
    """Append ``fields`` + pid, node_id and t to the pool events of the run that owns ``ckpt_root``
    (``<run_dir>/checkpoints``)."""
    path = pool_events_path(os.path.dirname(os.path.normpath(ckpt_root)))
    line = {**fields, "pid": os.getpid(), "node_id": node_id(), "t": time.time()}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    append_line(LocalFileSystem(), path, json.dumps(line))


def read_pool_events(run_dir: str, pool: str | None = None, event: str = "started") -> list[dict[str, Any]]:
    """A run's records of one kind (``started`` or ``stopped``), oldest first (``pool`` filters by name)."""
    path = pool_events_path(run_dir)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        events = [json.loads(line) for line in f if line.strip()]
    return [e for e in events if (pool is None or e["pool"] == pool) and e.get("event") == event]


def weights_digest(workers: dict[str, Any]) -> dict[str, str]:
    """sha256 of the policy's full (unsharded) weights on this rank, by role (``inference_module``:
    the plain copy the rollout engine uses, synced after each update). Ranks in step: equal digests."""
    out = {}
    for role, worker in workers.items():
        module = getattr(worker, "inference_module", None) if role == "policy" else None
        if module is None:
            continue
        h = hashlib.sha256()
        for name, t in sorted(module.state_dict().items()):
            h.update(name.encode() + t.detach().cpu().float().numpy().tobytes())
        out[role] = h.hexdigest()
    return out


def lost_ranks(run_dir: str, pool: str, world_size: int) -> dict[int, dict[str, str]]:
    """Ranks (< ``world_size``) of ``pool`` whose last recorded Ray node is no longer alive:
    {rank: {node_id, ip}} (ip from Ray's node table; "?" when the node is unknown to it)."""
    import ray

    last: dict[int, str] = {}
    for e in read_pool_events(run_dir, pool):
        if e.get("node_id") and e["rank"] < world_size:
            last[e["rank"]] = e["node_id"]
    nodes = {n["NodeID"]: n for n in ray.nodes()}
    return {rank: {"node_id": nid, "ip": str(nodes.get(nid, {}).get("NodeManagerAddress", "?"))}
            for rank, nid in sorted(last.items()) if not nodes.get(nid, {}).get("Alive", False)}
