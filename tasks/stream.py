"""The streaming rollout's take (``trainer.async_mode: stream``, docs/async.md "Streaming").

The rollout pool generates prompt groups continuously (:mod:`workers.group_stream`); an iteration
*takes* ``data.prompts_per_iteration`` finished groups from it with the train flow's
``take_groups`` task — the iteration's ``rollout`` (``iter_<k>/rollout``, the ``rollout`` cache
key, so a re-run iteration gets the same groups back from Prefect's cache).

The driver (:class:`flows.stream_feed.GroupStream`) names every group in flight (``wanted``: gid,
prompts batch and row, seed) and spare prompts the take may start when it drops a group; the task
makes the pool hold exactly the wanted groups (a rank that restarted gets its groups again),
waits for enough finished ones, checks each against the staleness bound, and saves the rollout.
Per group, staleness = the trainer's version − the oldest token's version; past
``trainer.max_staleness`` the group is generated again (``staleness_policy: wait``) or dropped and
replaced by a spare prompt (``drop``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hybridflow.algorithms import position_ids_from_mask
from hybridflow.batch import Batch
from hybridflow.metric_names import METRIC_NAMES as M
from tasks.common import RunContext
from tasks.node import node
from tasks.pools import pool_of
from tasks.rollout import driver_rollout_task
from tasks.types import RolloutResult
from tasks.weight_sync import weight_sync
from workers.rollout.base import left_pad
from workers.rollout.multi_turn import merge_prompt_metrics

POLL_S = 0.2


class StreamStalled(RuntimeError):
    """The rollout pool made no progress for ``trainer.stream_timeout_s`` seconds while a take waited."""


class StreamShortError(RuntimeError):
    """Too few groups: the take dropped stale groups and ran out of spare prompts."""


def _prompt_rows(entries: list[dict[str, Any]]) -> tuple[dict[int, Batch], dict[str, Batch]]:
    """gid → its one-row prompt batch, loaded from each distinct prompts batch once."""
    batches: dict[str, Batch] = {}
    rows: dict[int, Batch] = {}
    for e in entries:
        if e["uri"] not in batches:
            batches[e["uri"]] = Batch.load(e["uri"], expected_checksum=e["checksum"])
        rows[int(e["gid"])] = batches[e["uri"]].index([int(e["row"])])
    return rows, batches


def _sync_record(gid: int, prompt: Batch, seed: int, multi_turn: bool = False) -> dict[str, Any]:
    """What the rollout pool needs to start group ``gid``: its prompt ids and seed; a multi-turn
    group also the prompt row's non-tensors (``fields``: raw_chat, extra_info, ..., what the
    environments' reset reads)."""
    ids, mask = prompt["prompt_ids"][0], prompt["prompt_mask"][0].bool()
    out = {"gid": gid, "prompt": ids[mask].tolist(), "seed": int(seed)}
    if multi_turn:
        out["fields"] = {k: v[0] for k, v in prompt.non_tensors.items()}
    return out


def assemble(groups: list[dict[str, Any]], prompts: dict[int, Batch], n: int, pad_id: int) -> Batch:
    """The rollout batch of finished ``groups`` (records of :meth:`GroupStreamer.pop`, in the order
    trained): each group's prompt row repeated ``n`` times with response_ids / response_mask /
    rollout_log_probs / rollout_token_versions ``[B, R]`` (R = the longest response), position_ids,
    finish_reason, response_length, rollout_version (per row: its oldest token's version) and
    ``stream_gid`` (the group's id). Multi-turn groups (records with ``multi_turn``) also replace
    prompt_ids / prompt_mask by the conversation starts (an environment's reset may change them),
    set response_mask True on the model's tokens only, observation_mask on the others, and the
    rollout's per-row non-tensors (env_reward, num_turns, messages, raw_prompt, extra_info);
    rollout_version is then the oldest *model* token's version."""
    rows = Batch.concat([prompts[int(g["gid"])] for g in groups]).repeat_interleave(n)
    flat = [(g, k) for g in groups for k in range(n)]
    width = max(1, max(len(g["tokens"][k]) for g, k in flat))
    b = len(flat)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    real = torch.zeros((b, width), dtype=torch.bool)
    lps = torch.zeros((b, width), dtype=torch.float32)
    vers = torch.zeros((b, width), dtype=torch.long)
    for i, (g, k) in enumerate(flat):
        m = len(g["tokens"][k])
        ids[i, :m] = torch.tensor(g["tokens"][k], dtype=torch.long)
        real[i, :m] = True
        lps[i, :m] = torch.tensor(g["log_probs"][k], dtype=torch.float32)
        vers[i, :m] = torch.tensor(g["versions"][k], dtype=torch.long)
    mask = _multi_turn_fields(rows, groups, flat, real, pad_id) if any("multi_turn" in g for g in groups) else real
    oldest = torch.where(mask, vers, torch.iinfo(torch.long).max).min(-1).values
    oldest = torch.where(mask.any(-1), oldest, vers.max())  # a row with no (model) token: the newest version
    for key, value in [("response_ids", ids), ("response_mask", mask), ("rollout_log_probs", lps),
                       ("rollout_token_versions", vers)]:
        rows.set(key, value)
    rows.set("position_ids", position_ids_from_mask(torch.cat([rows["prompt_mask"].bool(), real], dim=1)))
    rows.set("finish_reason", [g["finish"][k] for g, k in flat])
    rows.set("response_length", mask.sum(-1).tolist())
    rows.set("rollout_version", oldest)
    rows.set("stream_gid", [int(g["gid"]) for g, _ in flat])
    return rows


def _multi_turn_fields(rows: Batch, groups: list[dict[str, Any]], flat: list[tuple[dict[str, Any], int]],
                      real: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Set the multi-turn fields of :func:`assemble` on ``rows`` (``real``: [B, R] every response
    token); returns the response_mask (model tokens)."""
    model = torch.zeros_like(real)
    for i, (g, k) in enumerate(flat):
        m = g["multi_turn"]["model_mask"][k]
        model[i, :len(m)] = torch.tensor(m, dtype=torch.bool)
    p_ids, p_mask = left_pad([g["multi_turn"]["prompts"][k] for g, k in flat], pad_id)
    rows.set("prompt_ids", p_ids)
    rows.set("prompt_mask", p_mask)
    rows.set("observation_mask", real & ~model)
    for key in groups[0]["multi_turn"]["non_tensors"]:
        rows.set(key, [g["multi_turn"]["non_tensors"][key][k] for g, k in flat])
    return model


def _metrics(rows: Batch, groups: list[dict[str, Any]], version: int, waited_s: float, stats: list[dict[str, float]],
             regenerated: int, dropped: int, max_response: int, n: int) -> dict[str, float]:
    """The take's metrics: response lengths, per-token staleness (the update's version − each
    token's), groups regenerated / dropped (as trajectories), and the streamer's counters."""
    mask, vers = rows["response_mask"], rows["rollout_token_versions"]
    lengths = mask.sum(-1).float()
    token_age = (version - vers)[mask].float()
    mixed = sum(1 for g in groups if len({v for row in g["versions"] for v in row}) > 1)
    spans = partial_spans(vers, mask)
    busy = sum(s["busy_s"] for s in stats)
    idle = sum(s["idle_s"] for s in stats)
    started = min(g["started_at"] for g in groups)
    finished = max(g["finished_at"] for g in groups)
    return {
        "stream/generation_span_s": finished - started,
        "timing_s/stream_wait": waited_s,
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "response_length/clip_ratio": float((lengths >= max_response).float().mean()),
        M["staleness_mean"]: float(token_age.mean()) if token_age.numel() else 0.0,
        M["staleness_max"]: float(token_age.max()) if token_age.numel() else 0.0,
        M["rollout_weights_version"]: float(rows["rollout_version"].min()),
        M["regenerated_stale"]: float(regenerated * n),
        M["dropped_stale"]: float(dropped * n),
        "stream/groups_with_several_versions": float(mixed),
        "stream/chunks_per_group": sum(g["chunks"] for g in groups) / len(groups),
        "stream/weight_loads": float(sum(s["weight_loads"] for s in stats)),
        "stream/interrupted_rows": float(sum(s["interrupted_rows"] for s in stats)),
        "stream/paused_rows": float(sum(s.get("paused_rows", 0) for s in stats)),
        "stream/prefill_tokens": float(sum(s["prefill_tokens"] for s in stats)),
        "stream/busy_fraction": busy / (busy + idle) if busy + idle > 0 else 0.0,
        # verl fully-async's names: trajectories whose tokens span several weights versions, the widest span
        "partial/partial_ratio": float((spans > 1).float().mean()) if spans.numel() else 0.0,
        "partial/max_partial_span": float(spans.max()) if spans.numel() else 0.0,
        "rollouter/idle_ratio": idle / (busy + idle) if busy + idle > 0 else 0.0,
    }


def partial_spans(token_versions: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """How many weights versions each trajectory's tokens span: newest − oldest + 1 over its
    response tokens (1: generated under one version; a partial rollout continued under newer
    weights spans more; 0 for a row without response tokens).

    token_versions: ``rollout_token_versions`` [B, R] int64; response_mask: [B, R] (0/1 or bool).
    Returns [B] int64. verl's fully-async ``partial/max_partial_span`` is its maximum."""
    mask = response_mask.bool()
    big = torch.iinfo(torch.int64).max
    newest = token_versions.masked_fill(~mask, -1).max(-1).values
    oldest = token_versions.masked_fill(~mask, big).min(-1).values
    return torch.where(mask.any(-1), newest - oldest + 1, torch.zeros_like(newest))


@node(name="rollout", retries=2, roles=("rollout",))
def _take_groups(run: RunContext, wanted: list, spare: list, count: int, policy_version: int,
                 published_version: int | None = None) -> tuple[Batch, RolloutResult]:
    """``count`` finished groups of the stream (module docstring). ``wanted`` / ``spare``: group
    entries ``{"gid", "uri", "checksum", "row", "seed"}`` (in flight / not yet started);
    ``policy_version``: the weights the update that follows starts from (staleness is counted
    against it); ``published_version``: the newest version published to the rollout pool
    (``trainer.updates_per_sync``; None: ``policy_version``), which every rank must hold. With
    ``algorithm.filter_groups`` each finished group is scored first and one whose samples all score
    alike is replaced by a spare prompt (DAPO dynamic sampling refilling the buffer, verl V1's
    ReplayBufferAsync), or taken as it is when no spare is left (``stream/zero_variance_taken``;
    the filter_groups node then drops it). Returns the rollout and a RolloutResult whose
    ``groups`` are the gids taken (training order), ``dropped`` those dropped as stale or
    filtered and ``started`` the spares it started in their place. Raises StreamShortError when
    stale drops exhaust the spares."""
    cfg = run.cfg()
    t = cfg.trainer
    engine = pool_of(run, "rollout")
    prompts, _ = _prompt_rows([*wanted, *spare])
    live = {int(e["gid"]): e for e in wanted}
    spares = [e for e in spare]
    started: list[int] = []
    dropped: list[int] = []
    regenerated = 0
    t0 = time.perf_counter()

    def sync() -> None:
        engine.stream_sync([_sync_record(g, prompts[g], int(e["seed"]), cfg.rollout.is_multi_turn) for g, e in sorted(live.items())])

    # a rank that restarted gets the trainer's current weights again (the streamer loads them itself)
    weight_sync(run, rollout=engine).deliver(policy_version if published_version is None else published_version)
    sync()
    taken: list[int] = []
    records: dict[int, dict[str, Any]] = {}
    filtered: list[int] = []
    zero_variance_taken = 0
    filtering = cfg.algorithm.filter_groups
    n = cfg.rollout.samples_per_prompt

    def start_spare(gid: int, why: str) -> None:
        del live[gid]
        if not spares:
            raise StreamShortError(
                f"iteration {run.iteration}: {why} and no spare prompt is left ({len(taken)} of {count} groups taken); "
                "raise rollout.max_inflight_groups or use trainer.staleness_policy=wait")
        e = spares.pop(0)
        live[int(e["gid"])] = e
        started.append(int(e["gid"]))

    progress, last_progress = None, time.monotonic()
    while len(taken) < count:
        finished = {int(f["gid"]): f for per_rank in engine.stream_finished() for f in per_rank}
        now_progress = (len(finished), sum(r["tokens"] + r.get("turns", 0) for r in engine.stream_stats(reset=False)))
        if now_progress != progress:
            progress, last_progress = now_progress, time.monotonic()
        elif time.monotonic() - last_progress > t.stream_timeout_s:
            raise StreamStalled(
                f"iteration {run.iteration}: the rollout pool generated nothing for {t.stream_timeout_s:g} s "
                f"(trainer.stream_timeout_s) with "
                f"{len(live)} group(s) in flight and {len(taken)} of {count} taken (a hung engine, or weights "
                f"v{policy_version} never reached it); the take is retried, then the run stops resumable")
        if t.stream_order == "submission":
            order = [g for g in sorted(live) if g not in taken][: count - len(taken)]
            ready = [g for g in order if g in finished]
            if len(ready) < len(order):
                ready = []  # in submission order: wait for the oldest groups first
        else:
            ready = [g for g in sorted(finished, key=lambda g: (finished[g]["finished_at"], g)) if g not in taken]
        changed = False
        fresh: list[int] = []
        for gid in ready[: count - len(taken)]:
            stale = policy_version - int(finished[gid]["oldest_version"]) > t.max_staleness
            if not stale:
                fresh.append(gid)
                continue
            engine.stream_pop([gid])  # forgotten on its rank
            if t.staleness_policy == "wait":  # synced again below: generated anew with the newest weights
                regenerated += 1
            else:
                dropped.append(gid)
                start_spare(gid, f"trainer.staleness_policy=drop dropped {len(dropped)} stale group(s)")
            changed = True
        if filtering and fresh:  # DAPO dynamic sampling: a group whose samples all score alike is replaced
            recs = {int(r["gid"]): r for per_rank in engine.stream_pop(fresh) for r in per_rank}
            pad_id = int(engine.stream_stats(reset=False)[0]["pad_id"])
            alike = _zero_variance(run, [recs[g] for g in fresh], prompts, n, pad_id)
            for gid in fresh:
                if gid in alike and spares:
                    filtered.append(gid)
                    start_spare(gid, "algorithm.filter_groups")
                    changed = True
                else:
                    zero_variance_taken += gid in alike
                    taken.append(gid)
                    records[gid] = recs[gid]
        else:
            taken += fresh
        if changed:
            sync()
        if len(taken) < count:
            time.sleep(POLL_S)
    waited = time.perf_counter() - t0
    for per_rank in engine.stream_pop([g for g in taken if g not in records]):
        for rec in per_rank:
            records[int(rec["gid"])] = rec
    groups = [records[g] for g in taken]
    stats = engine.stream_stats()
    rows = assemble(groups, prompts, n, int(stats[0]["pad_id"]))
    rows.meta["metrics"] = _metrics(rows, groups, policy_version, waited, stats, regenerated, len(dropped),
                                    cfg.rollout.max_response_tokens, n)
    if cfg.rollout.is_multi_turn:  # multi_turn/*, tool/*, env/* over the groups taken
        rows.meta["metrics"].update(merge_prompt_metrics([g["multi_turn"]["metrics"] for g in groups]))
    if filtering:
        rows.meta["metrics"].update({"stream/filtered_groups": float(len(filtered)),
                                     "stream/zero_variance_taken": float(zero_variance_taken)})
    rows.meta["weights_version"] = int(rows["rollout_version"].min())
    return rows, RolloutResult(node="rollout", rollout_version=int(rows["rollout_version"].min()),
                               started_at=min(g["started_at"] for g in groups),
                               finished_at=max(g["finished_at"] for g in groups), groups=tuple(taken),
                               dropped=tuple(dropped + filtered), started=tuple(started))


def _zero_variance(run: RunContext, groups: list[dict[str, Any]], prompts: dict[int, Batch], n: int,
                   pad_id: int) -> set[int]:
    """The gids among ``groups`` whose ``n`` samples all get the same score from the reward pool
    (the sum of token_level_scores over the response; DAPO's zero-variance groups, Yu et al. 2025
    §3.2). The reward node scores the taken groups again in the iteration (rule rewards are cheap;
    a model-judged reward pays twice)."""
    rows = assemble(groups, prompts, n, pad_id)
    scored = pool_of(run, "reward").compute_rewards(rows)
    seq = (scored["token_level_scores"] * scored["response_mask"]).sum(-1)
    alike = set()
    for i, g in enumerate(groups):
        s = seq[i * n:(i + 1) * n]
        if n < 2 or bool((s == s[0]).all()):
            alike.add(int(g["gid"]))
    return alike


take_groups = driver_rollout_task(_take_groups, "take_groups")  # (wanted, spare, count, policy_version, published_version) -> RolloutResult, on the rollout pool

__all__ = ["take_groups", "assemble", "StreamShortError", "StreamStalled"]
