"""Continuous generation of prompt groups with partial rollouts across weight updates
(``trainer.async_mode: stream``, docs/async.md "Streaming").

A :class:`GroupStreamer` lives on each rank of the rollout pool and generates, on a thread of its
own, every group (one prompt × ``n`` samples) the driver submitted to it, in chunks of
``rollout.partial_chunk_tokens`` new tokens. Between two chunks it may load newer weights: an
unfinished row then continues under the new weights with the tokens generated so far as a prefix,
which the engine prefills again (abort-and-resubmit semantics, ``rollout.partial: abort``; verl's
fully-async partial rollouts, slime's and AReaL's interruptible generation). Every response token
records the weights version that sampled it and its log-prob under those weights, so a group's
tokens may come from several versions.

It only needs the engine's ``generate`` (prompt ids, left padded → responses), so it runs on any
engine: a prompt + prefix is a new prompt. An engine that can stop a ``generate`` mid-way
(capability ``partial_rollout_interrupt``: hf, and vllm through its step loop) is not cut at every
chunk boundary in completion order: each call runs to the end of its responses on one KV cache and
is interrupted at the first chunk boundary (a multiple of ``chunk_tokens`` new tokens) at which
newer weights are in the inbox (``newer_weights``) or the streamer is stopping. The weights change
at the same places as with a cut at every boundary, and nothing is re-prefilled while they do not
change (``bench stream_chunks`` measured a cut every 16 tokens at 2.2× the wall time of whole
responses). With ``rollout.partial: pause`` (capability ``partial_rollout_pause``: vllm, hf) the call is
not cut there: the newest weights load while the engine runs no step and its requests go on with
the KV cache they have; the output's ``weight_epochs`` give each token its version.

Two schedules (``trainer.stream_order``):

- ``completion``: each chunk loads the newest weights in the inbox first; finished groups are
  handed out in the order they finished. Fast; exactly-once but not bitwise reproducible (where an
  update lands in a response depends on timing).
- ``submission``: a fixed schedule. Group ``g`` belongs to cohort ``j = g // G + 1`` (the
  iteration it trains in, ``G = data.prompts_per_iteration``); its chunk ``c`` is generated with
  version ``V(j, c) = min(j − 1, max(0, j − 1 − s) + c)`` (``s = trainer.max_staleness``) from one
  call per (cohort, chunk), seeded by (seed, cohort, chunk). Work runs in order of (V, cohort);
  version v + 1 loads once every chunk scheduled at v is done, waiting for the trainer when it is
  not yet published. The trajectories therefore depend only on the seed and the trainer's weights,
  not on timing (reproducible for a given seed when no fault occurs), and a cohort's first chunks
  still overlap the trainer's updates.

Multi-turn rollouts (``rollout.tools`` / ``rollout.environment``): each group is generated whole,
every turn with its environments, by :class:`workers.group_stream_turns.MultiTurnGroups` on this
thread; newer weights load between turns (``between_turns``), never inside a model turn, and never
reset an environment. Completion order only.

Groups are plain data (token lists); the pool's methods (:class:`workers.rollout_worker.RolloutWorker`)
move them between the driver and this thread. The streamer holds no Ray or Prefect state.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workers.group_stream_turns import MultiTurnGroups
from workers.rollout.base import left_pad

_log = logging.getLogger(__name__)
CHUNK_SEED_STRIDE = 7_919  # chunk c of a call seeded s samples with s + c·stride (completion order)


@dataclass
class _Row:
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None


@dataclass
class _Group:
    gid: int
    prompt: list[int]
    seed: int
    rows: list[_Row]
    submitted_at: float
    fields: dict[str, Any] = field(default_factory=dict)  # the prompt row's non-tensors (multi-turn: raw_chat, ...)
    multi_turn: dict[str, Any] | None = None  # what a multi-turn rollout adds to the record (MultiTurnGroups)
    started_at: float = 0.0
    finished_at: float = 0.0
    chunks: int = 0
    done_seq: int = -1

    @property
    def finished(self) -> bool:
        return all(r.finish is not None for r in self.rows)

    def record(self) -> dict[str, Any]:
        """The finished group as the driver takes it (plain lists)."""
        out = {"gid": self.gid, "tokens": [r.tokens for r in self.rows], "log_probs": [r.log_probs for r in self.rows],
               "versions": [r.versions for r in self.rows], "finish": [r.finish for r in self.rows],
               "started_at": self.started_at, "finished_at": self.finished_at, "chunks": self.chunks}
        if self.multi_turn is not None:  # model_mask, prompts, non_tensors, metrics (per row / per group)
            out["multi_turn"] = self.multi_turn
        return out


class StreamStopped(RuntimeError):
    """The streamer was stopped, or its thread failed (the failure is chained)."""


class GroupStreamer:
    """See the module docstring.

    engine: a rollout engine (``generate(prompt_ids, prompt_mask, sampling)``); sampling: the
    training SamplingParams (its ``n``, ``max_new_tokens`` and stop ids; seeds come per group);
    pad_id: the tokenizer's pad id; chunk_tokens: new tokens per chunk (≥ 1); batch_rows: rows per
    engine call at most (``rollout.generation_batch_trajectories``); order: ``completion`` |
    ``submission``; group_size_iter: G, groups per iteration (the cohort size, submission order);
    max_staleness: s; load_newest: ``() -> int``, loads the newest weights in the inbox and returns
    the version loaded (completion order); load_version: ``(v) -> bool``, loads exactly version v
    if the inbox has it (submission order; False: not yet published); version: ``() -> int``, the
    loaded version; lock: held around each engine call and weights load (the worker's);
    newer_weights: ``() -> bool``, whether the inbox holds weights newer than those loaded (called
    during an engine call, without the lock; None: calls are cut at every chunk boundary);
    pause: ``rollout.partial: pause`` — an elastic call that newer weights interrupt loads them in
    place and its unfinished rows go on generating on the engine's KV cache (capability
    ``partial_rollout_pause``; completion order only). Raises ValueError when the engine lacks it.
    multi_turn: a :class:`~workers.rollout.multi_turn.MultiTurnRollout` on ``engine`` (None:
    single-turn); between_turns: with it, newer weights load between turns (module docstring).
    Raises ValueError for a multi-turn streamer in submission order or with ``pause``.
    """

    def __init__(self, engine: Any, sampling: Any, *, pad_id: int, chunk_tokens: int, batch_rows: int, order: str,
                 group_size_iter: int, max_staleness: int, load_newest: Callable[[], int],
                 load_version: Callable[[int], bool], version: Callable[[], int], lock: threading.Lock,
                 newer_weights: Callable[[], bool] | None = None, pause: bool = False, multi_turn: Any = None,
                 between_turns: bool = False) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"rollout.partial_chunk_tokens must be ≥ 1, got {chunk_tokens}")
        if order not in ("completion", "submission"):
            raise ValueError(f"trainer.stream_order must be completion or submission, got {order!r}")
        self.engine, self.sampling, self.pad_id = engine, sampling, pad_id
        self.chunk_tokens, self.batch_rows, self.order = chunk_tokens, max(1, batch_rows), order
        self.G, self.s = max(1, group_size_iter), max_staleness
        self._load_newest, self._load_version, self._version, self._lock = load_newest, load_version, version, lock
        self._newer_weights = newer_weights
        from workers.rollout.capabilities import engine_capabilities

        if multi_turn is not None and (order != "completion" or pause):
            raise ValueError("a multi-turn streamer runs in completion order and never pauses inside a model turn "
                             f"(order={order}, pause={pause})")
        self.turns = None if multi_turn is None else MultiTurnGroups(
            multi_turn, between_turns=between_turns, load_newest=load_newest, version=version,
            stopping=lambda: self._stop, count=self._count)
        # one engine call per response, interrupted at a chunk boundary when newer weights arrive
        caps = engine_capabilities(engine)
        self.elastic = (multi_turn is None and order == "completion" and newer_weights is not None
                        and caps.partial_rollout_interrupt)
        if pause and not (self.elastic and caps.partial_rollout_pause):
            raise ValueError(f"rollout.partial=pause: {type(engine).__name__} does not pause in place here "
                             f"(offers {', '.join(caps.partial_modes)}; pause needs trainer.stream_order=completion)")
        self.pause = pause
        self._call_versions: list[int] = []  # versions loaded during the current engine call, in order
        self.groups: dict[int, _Group] = {}  # submitted, not yet taken
        self._done_seq = 0
        self._cv = threading.Condition()
        self._stop = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.stats = {"chunks": 0, "calls": 0, "interrupted_rows": 0, "paused_rows": 0, "weight_loads": 0, "tokens": 0,
                      "turns": 0, "prefill_tokens": 0, "idle_s": 0.0, "busy_s": 0.0}

    # ---- the driver's side (called from the pool's method threads) ----------------------------
    def sync(self, wanted: list[dict[str, Any]]) -> dict[str, int]:
        """Make the set of groups this streamer holds the ``wanted`` ones: each ``{"gid", "prompt"
        (token ids, unpadded), "seed"}`` and, for a multi-turn streamer, ``"fields"`` (the prompt
        row's non-tensors: raw_chat, uid, extra_info, ...); groups not wanted any more (taken,
        dropped or from before a restart) are forgotten; new ones start. Returns {"added",
        "dropped", "held"}."""
        self._raise_if_failed()
        keep = {int(w["gid"]) for w in wanted}
        with self._cv:
            dropped = [g for g in self.groups if g not in keep]
            for g in dropped:
                del self.groups[g]
            added = 0
            for w in wanted:
                gid = int(w["gid"])
                if gid not in self.groups:
                    prompt = [int(t) for t in w["prompt"]]
                    if not prompt:
                        raise ValueError(f"group {gid}: empty prompt")
                    self.groups[gid] = _Group(gid, prompt, int(w["seed"]),
                                              [_Row() for _ in range(self.sampling.n)], time.time(),
                                              fields=dict(w.get("fields") or {}))
                    added += 1
            self._cv.notify_all()
            return {"added": added, "dropped": len(dropped), "held": len(self.groups)}

    def take_stats(self) -> dict[str, float]:
        """The counters since the last call (then reset): chunks (row-chunks), engine calls,
        interrupted_rows (unfinished rows when new weights loaded), paused_rows (those of them that
        went on in place, ``pause``), weight_loads, tokens generated, turns (rounds of model turns of
        multi-turn calls, which count as progress before their group's tokens are in),
        prefill_tokens (prompt + prefix tokens fed to the engine; a multi-turn call counts its
        prompts × n only), idle_s / busy_s (seconds)."""
        with self._cv:
            out = dict(self.stats)
            self.stats = dict.fromkeys(self.stats, 0)
            self.stats["idle_s"] = self.stats["busy_s"] = 0.0
            return out

    def finished(self) -> list[dict[str, Any]]:
        """The finished groups held, as ``{"gid", "done_seq", "oldest_version", "finished_at"}`` in
        completion order (no token data)."""
        self._raise_if_failed()
        with self._cv:
            done = sorted((g for g in self.groups.values() if g.done_seq >= 0), key=lambda g: g.done_seq)
            return [{"gid": g.gid, "done_seq": g.done_seq, "finished_at": g.finished_at,
                     "oldest_version": min((min(r.versions) for r in g.rows if r.versions), default=self._version())}
                    for g in done]

    def pop(self, gids: list[int]) -> list[dict[str, Any]]:
        """Hand out the finished groups ``gids`` (their records, :meth:`_Group.record`) and forget
        them. Raises KeyError naming a gid that is not held or not finished."""
        with self._cv:
            missing = [g for g in gids if g not in self.groups or self.groups[g].done_seq < 0]
            if missing:
                raise KeyError(f"groups {missing} are not finished on this rank")
            return [self.groups.pop(g).record() for g in gids]

    # ---- the thread ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="group-streamer", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def kick(self) -> None:
        """Wake the thread (new weights may be in the inbox)."""
        with self._cv:
            self._cv.notify_all()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _raise_if_failed(self) -> None:
        """Raise the thread's failure once (StreamStopped, chained); the next :meth:`start` runs a
        fresh thread, so a retried take goes on with the groups it syncs."""
        error, self._error = self._error, None
        if error is not None:
            raise StreamStopped(f"the group streamer failed: {type(error).__name__}: {error}") from error

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    if self._stop:
                        return
                    work = self._next_work()
                    if work is None:
                        t0 = time.perf_counter()
                        self._cv.wait(0.2)
                        self.stats["idle_s"] += time.perf_counter() - t0
                        continue
                t0 = time.perf_counter()
                worked = self._generate(*work)
                self.stats["busy_s" if worked else "idle_s"] += time.perf_counter() - t0
        except BaseException as exc:  # noqa: BLE001 - kept and raised to the next driver call
            _log.exception("group streamer failed")
            self._error = exc

    # ---- what to generate next --------------------------------------------------------------------
    def cohort(self, gid: int) -> int:
        return gid // self.G + 1

    def scheduled_version(self, cohort: int, chunk: int) -> int:
        """V(j, c) of the submission schedule (module docstring)."""
        return min(cohort - 1, max(0, cohort - 1 - self.s) + chunk)

    def _open(self) -> list[_Group]:
        return [g for g in sorted(self.groups.values(), key=lambda g: g.gid) if not g.finished]

    def _next_work(self) -> tuple[list[_Group], int | None, int] | None:
        """(groups, version to load first or None for the newest, seed) of the next engine call, or
        None when there is nothing to do now. Called with the condition held."""
        open_groups = self._open()
        if not open_groups:
            return None
        if self.order == "completion":
            picked, rows = [], 0
            for g in open_groups:
                live = sum(r.finish is None for r in g.rows)
                if picked and rows + live > self.batch_rows:
                    break
                picked.append(g)
                rows += live
            return picked, None, 0
        # submission: the (V, cohort)-smallest cohort chunk; its version must be published
        loaded = self._version()
        best: tuple[int, int] | None = None
        for g in open_groups:
            key = (max(self.scheduled_version(self.cohort(g.gid), g.chunks), loaded), self.cohort(g.gid))
            best = key if best is None or key < best else best
        v, j = best
        chunk = min(g.chunks for g in open_groups if self.cohort(g.gid) == j)
        picked = [g for g in open_groups if self.cohort(g.gid) == j and g.chunks == chunk]
        return picked, v, (j * 1_000_003 + chunk) % (2**31)

    # ---- one engine call ---------------------------------------------------------------------
    def _generate(self, groups: list[_Group], version: int | None, seed: int) -> bool:
        """One chunk of ``groups`` (False: the version it needs is not published yet; waited a little)."""
        with self._lock:
            before = self._version()
            if version is None:
                loaded = self._load_newest()
            elif version != before:
                # not yet published: wait for the trainer
                loaded = self._version() if self._load_version(version) else -1
            else:
                loaded = before
            if loaded < 0:
                pass
            elif loaded != before:
                self.stats["weight_loads"] += 1
                self.stats["interrupted_rows"] += sum(1 for g in groups for r in g.rows if r.finish is None and r.tokens)
            if loaded >= 0:
                self._chunk(groups, loaded, seed)
        if loaded < 0:
            with self._cv:
                self._cv.wait(0.2)
            return False
        with self._cv:
            for g in groups:
                g.chunks += 1
                if g.finished and g.done_seq < 0 and g.gid in self.groups:
                    g.finished_at = time.time()
                    g.done_seq = self._done_seq
                    self._done_seq += 1
            self._cv.notify_all()
        return True

    def _chunk(self, groups: list[_Group], version: int, seed: int) -> None:
        fresh = [g for g in groups if g.chunks == 0]
        going = [(g, r) for g in groups if g.chunks > 0 for r in g.rows if r.finish is None]
        now = time.time()
        for g in fresh:
            g.started_at = now
        if self.turns is not None:  # each group whole, every turn with its environments (the lock is held)
            if not fresh:
                return
            ids, mask = left_pad([g.prompt for g in fresh], self.pad_id)
            self._count("calls", 1)
            self._count("prefill_tokens", int(mask.sum()) * self.sampling.n)
            self.engine.wake_up()
            try:
                self.turns.generate(fresh, ids, mask, self._sampling(self.sampling.n, self.sampling.max_new_tokens,
                                                                     fresh[0].seed))
            finally:
                self.engine.sleep()
            return
        if fresh:
            self._call_fresh(fresh, version, seed)
        if going and not (self.elastic and fresh and self._should_interrupt()):
            self._call_going(going, version, seed)  # (an elastic call skips it when newer weights came meanwhile)

    def _should_interrupt(self) -> bool:
        return self._stop or bool(self._newer_weights())

    def _interrupt(self, k: int) -> bool:
        """An elastic call's ``interrupt``: at a chunk boundary, newer weights or a stop end it."""
        return k % self.chunk_tokens == 0 and self._should_interrupt()

    def _pause(self, unfinished: int) -> bool:
        """A pausing call's ``pause``: the engine runs no step; load the newest weights (the lock is
        held by :meth:`_generate`) and let its ``unfinished`` rows go on. False when stopping."""
        if self._stop:
            return False
        before = self._version()
        loaded = self._load_newest()
        if loaded != before:
            self._call_versions.append(loaded)
            self.stats["weight_loads"] += 1
            self.stats["interrupted_rows"] += unfinished
            self.stats["paused_rows"] += unfinished
        return True

    def _room(self, generated: int) -> int:
        """New tokens one call may add to a row that has ``generated``: a chunk, or (elastic) the
        rest of the response."""
        left = self.sampling.max_new_tokens - generated
        return left if self.elastic else min(self.chunk_tokens, left)

    def _sampling(self, n: int, max_new: int, seed: int) -> Any:
        return dataclasses.replace(self.sampling, n=n, max_new_tokens=max_new, seed=seed)

    def _call_fresh(self, groups: list[_Group], version: int, seed: int) -> None:
        """A group's first chunk: one prompt, n samples (the engine prefills the prompt once)."""
        n = self.sampling.n
        chunk = self._room(0)
        seed = seed if self.order == "submission" else groups[0].seed
        out = self._engine_call([g.prompt for g in groups], self._sampling(n, chunk, seed))
        for i, g in enumerate(groups):
            for k, row in enumerate(g.rows):
                self._append(row, out, i * n + k, version)

    def _call_going(self, going: list[tuple[_Group, _Row]], version: int, seed: int) -> None:
        """Unfinished rows: prompt + what they generated so far, re-prefilled, one sample each. Cut
        at chunk boundaries, rows are grouped by how many tokens they may still add, so none passes
        max_new_tokens; an elastic call takes them all at once, up to the largest room, and each row
        keeps only what fits its own (:meth:`_append`)."""
        by_room: dict[int, list[tuple[_Group, _Row]]] = {}
        if self.elastic:
            by_room[max(self._room(len(r.tokens)) for _, r in going)] = list(going)
        else:
            for g, r in going:
                by_room.setdefault(self._room(len(r.tokens)), []).append((g, r))
        for room, rows in sorted(by_room.items()):
            call_seed = seed if self.order == "submission" else rows[0][0].seed + CHUNK_SEED_STRIDE * rows[0][0].chunks
            out = self._engine_call([g.prompt + r.tokens for g, r in rows], self._sampling(1, room, call_seed + room))
            for i, (_, r) in enumerate(rows):
                self._append(r, out, i, version)

    def _count(self, key: str, by: float) -> None:
        self.stats[key] += by

    def _engine_call(self, prompts: list[list[int]], sampling: Any) -> Any:
        ids, mask = left_pad(prompts, self.pad_id)
        self.stats["calls"] += 1
        self.stats["prefill_tokens"] += int(mask.sum())
        self.engine.wake_up()
        self._call_versions = [self._version()]
        try:
            if self.pause:
                return self.engine.generate(ids, mask, sampling, interrupt=self._interrupt, pause=self._pause)
            if self.elastic:
                return self.engine.generate(ids, mask, sampling, interrupt=self._interrupt)
            return self.engine.generate(ids, mask, sampling)
        finally:
            self.engine.sleep()

    def _append(self, row: _Row, out: Any, i: int, version: int) -> None:
        """Add output row ``i`` (sampled under ``version``; a paused call's tokens under the version
        its ``weight_epochs`` name) to ``row``, at most up to max_new_tokens; a row cut there ends
        with finish "length"."""
        k = int(out.response_mask[i].sum())
        left = self.sampling.max_new_tokens - len(row.tokens)
        cut = k > left
        k = min(k, left)
        row.tokens += out.response_ids[i, :k].tolist()
        row.log_probs += out.rollout_log_probs[i, :k].float().tolist()
        if out.weight_epochs is None:
            row.versions += [version] * k
        else:
            row.versions += [self._call_versions[e] for e in out.weight_epochs[i, :k].tolist()]
        self.stats["tokens"] += k
        self.stats["chunks"] += 1
        if out.finish_reason[i] == "stop" and not cut:
            row.finish = "stop"
        elif len(row.tokens) >= self.sampling.max_new_tokens:
            row.finish = "length"


__all__ = ["GroupStreamer", "StreamStopped"]
