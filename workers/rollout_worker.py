"""RolloutWorker: the ``rollout`` role — a generation-only copy of the policy for asynchronous
training (``trainer.max_staleness``, docs/async.md).

The trainer (the ``policy`` role, another pool) publishes its weights after every applied update
(:meth:`workers.policy.PolicyWorker.publish_weights`: CPU tensors put in Ray's object store,
tagged with their ``weights_version``). The update node hands the object refs to every rank of
this role (:meth:`receive_weights`), which keeps them in an inbox by version — while it may be
generating with older weights on another thread of its actor (the rollout pool's actors run two
calls at once). A generation asks for one exact version (:meth:`use_weights`): the weights of
that version are loaded from the inbox (older entries are evicted) before the engine runs, so
the schedule of versions, and with it the run, is deterministic.

Weights travel as plain tensors: the full state dict, or with LoRA (``model.lora_rank > 0``) only
the trainable adapter tensors (the base weights of both copies are the same initial model). They
reach the engine as they reach the policy's own (:class:`workers.weights_endpoint.WeightsEndpoint`):
with LoRA an engine that takes adapters (vLLM) gets the adapter only.
Sources: verl ``recipe/one_step_off_policy`` (a separate rollout worker group synced after each
update), AReaL's decoupled rollout workers.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from hybridflow.config import ExperimentConfig
from workers import checkpoint as C
from workers.dispatch import dispatch
from workers.generation import Generation
from workers.policy import POLICY_DIR, POLICY_OPTIM_DIR, build_policy_module
from workers.rollout.multi_turn import MultiTurnRollout
from workers.weights_endpoint import WeightsEndpoint


class WeightsUnavailable(RuntimeError):
    """The weights version a generation needs is neither loaded nor in the inbox."""


class RolloutWorker(Generation, WeightsEndpoint):
    """Generation on one rank of the rollout pool (see the module docstring).

    cfg: the experiment config; rank/world_size: this rank of the rollout pool; device: "cpu" / "cuda".
    namespace: the run's Ray namespace, where a multi-turn rollout finds the tools pool (None: the job's).
    """

    def __init__(self, cfg: ExperimentConfig, *, rank: int = 0, world_size: int = 1, device: str = "cpu",
                 namespace: str | None = None):  # fmt: skip
        from hybridflow.models import load_tokenizer, tokenizer_stop_ids
        from workers.rollout.base import build_engine

        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.device = torch.device(device)
        self.tokenizer = load_tokenizer(cfg.model)
        self.stop_ids = tokenizer_stop_ids(self.tokenizer)
        self.inference_module = build_policy_module(cfg, self.device)  # version 0: the trainer's initial weights
        self.inference_module.eval()
        self.engine = build_engine(cfg, model=self.inference_module, tokenizer=self.tokenizer, device=self.device)
        self._multi_turn = (MultiTurnRollout.from_config(self.engine, self.tokenizer, cfg, namespace)
                            if cfg.rollout.is_multi_turn else None)  # fmt: skip
        self.weights_version = 0
        self._inbox: dict[int, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()  # one generation or weights load at a time; receive_weights runs beside
        self._inbox_lock = threading.Lock()
        self._stream: Any = None  # the GroupStreamer under trainer.async_mode=stream (started on first use)

    # ---- weights ---------------------------------------------------------------------------
    @dispatch("broadcast")
    def receive_weights(self, refs: list[Any], *, version: int, keep: int) -> int:
        """Store the weights ``version`` (``refs``: ``[ObjectRef]`` of a tensor dict, as
        :meth:`PolicyWorker.publish_weights` returns it) in the inbox, keeping the ``keep`` newest.
        Runs while a generation may be in progress. Returns the number of tensors received."""
        import ray

        state = ray.get(refs[0])
        self._file(version, state, keep)
        return len(state)

    def _file(self, version: int, state: dict[str, torch.Tensor], keep: int) -> None:
        with self._inbox_lock:
            self._inbox[version] = state
            for old in sorted(self._inbox)[:-keep]:
                del self._inbox[old]
        if self._stream is not None:  # a streamer waiting for these weights goes on
            self._stream.kick()

    @dispatch("broadcast")
    def init_weight_group(self, host: str, port: int, world_size: int, epoch: int) -> int:
        """Join the weight-sync group as rank 1 + this rank (the policy's rank 0 joins at the same
        time; :class:`workers.weight_group.WeightGroup`). Returns ``epoch``."""
        return self._join_weight_group(self.rank + 1, host, port, world_size, epoch)

    @dispatch("broadcast")
    def weight_group_epoch(self) -> int | None:
        """The epoch of the weight-sync group this rank is in (None: none, e.g. after a restart)."""
        return self._group_epoch()

    @dispatch("broadcast")
    def receive_broadcast(self, layout: list[tuple[str, list[int], str]], *, version: int, keep: int) -> int:
        """Receive the weights ``version`` broadcast by the policy (``layout``: what it sends, in
        order) into fresh tensors on this rank's device and file them in the inbox, keeping the
        ``keep`` newest. Runs while a generation may be in progress. Returns the tensor count."""
        from workers.weight_group import empty_like_layout

        group = self._group(f"rollout rank {self.rank}")
        state = empty_like_layout(layout, self.device)
        group.broadcast(list(state.values()))
        self._file(version, state, keep)
        return len(state)

    @dispatch("broadcast")
    def inbox_versions(self) -> list[int]:
        """The weights versions held in the inbox, ascending."""
        with self._inbox_lock:
            return sorted(self._inbox)

    @dispatch("broadcast")
    def use_weights(self, version: int) -> int:
        """Generate with the weights of ``version`` from now on: loaded from the inbox unless they are
        loaded already; inbox entries older than it are dropped. Raises WeightsUnavailable naming the
        version and what the inbox holds. Returns the version."""
        with self._lock:
            if version == self.weights_version:
                return version
            with self._inbox_lock:
                state = self._inbox.get(version)
            if state is None:
                raise WeightsUnavailable(
                    f"rollout rank {self.rank}: weights version {version} is not in the inbox "
                    f"(holds {sorted(self._inbox)}; loaded: {self.weights_version})")
            self._install(version, state)
            return version

    @dispatch("dp_scatter")
    def generate_sequences(self, batch: Any, *, seed: int, validate: bool = False) -> Any:
        """:meth:`workers.generation.Generation.generate_sequences` on the loaded weights version."""
        with self._lock:
            return super().generate_sequences(batch, seed=seed, validate=validate)

    # ---- streaming (trainer.async_mode: stream, workers/group_stream.py) -----------------------
    def _streamer(self) -> Any:
        """This rank's :class:`~workers.group_stream.GroupStreamer`, built and started on first use.
        An engine call holds at most one iteration's trajectories (and ``generation_batch_trajectories``):
        the oldest groups, which the next take needs, finish first instead of with every group in flight.
        A multi-turn rollout generates each group whole, every turn with its environments; with
        ``rollout.partial: abort`` newer weights load between turns (workers/group_stream.py)."""
        from workers.group_stream import GroupStreamer
        from workers.rollout.base import sampling_params_from_config

        if self._stream is None:
            cfg = self.cfg
            self._stream = GroupStreamer(
                self.engine, sampling_params_from_config(cfg.rollout, self.stop_ids, seed=0),
                pad_id=int(self.tokenizer.pad_token_id), chunk_tokens=self._chunk_tokens(),
                batch_rows=min(cfg.rollout.generation_batch_trajectories,
                               cfg.data.prompts_per_iteration * cfg.rollout.samples_per_prompt),
                order=cfg.trainer.stream_order,
                group_size_iter=cfg.data.prompts_per_iteration, max_staleness=cfg.trainer.max_staleness,
                load_newest=self._load_newest, load_version=self._load_exact, version=lambda: self.weights_version,
                lock=self._lock, newer_weights=self._newer_weights, pause=cfg.rollout.partial == "pause",
                multi_turn=self._multi_turn, between_turns=cfg.rollout.partial == "abort")
        self._stream.start()
        return self._stream

    def _chunk_tokens(self) -> int:
        """Tokens per chunk: ``rollout.partial_chunk_tokens``; with ``rollout.partial: off`` a whole
        response (weights change only between groups)."""
        r = self.cfg.rollout
        return r.max_response_tokens if r.partial == "off" else r.partial_chunk_tokens

    def _newer_weights(self) -> bool:
        """Whether the inbox holds weights newer than those loaded (asked during a streamer's engine
        call, without the generation lock)."""
        with self._inbox_lock:
            return max(self._inbox, default=-1) > self.weights_version

    def _load_newest(self) -> int:
        """Load the newest weights in the inbox if newer than those loaded (the streamer holds the
        lock); returns the version loaded."""
        with self._inbox_lock:
            newest = max(self._inbox, default=-1)
        if newest > self.weights_version:
            self._load_exact(newest)
        return self.weights_version

    def _load_exact(self, version: int) -> bool:
        """Load ``version`` from the inbox (the caller holds the lock); False when neither it nor a
        newer one is there yet. When only newer ones are (a rank that restarted lost the older
        versions of the schedule), the oldest of those is loaded."""
        if version <= self.weights_version:
            return True
        with self._inbox_lock:
            state = self._inbox.get(version)
            if state is None:
                newer = [v for v in self._inbox if v > version]
                if not newer:
                    return False
                version = min(newer)
                state = self._inbox[version]
        self._install(version, state)
        return True

    def _install(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Load the published weights ``state`` of ``version`` into the engine (the caller holds the
        lock) and drop older inbox entries."""
        self._load_published(state, version=version, where=f"published policy weights v{version}")
        self.weights_version = version
        with self._inbox_lock:
            for old in [v for v in self._inbox if v < version]:
                del self._inbox[old]

    def _mine(self, gid: int) -> bool:
        return int(gid) % self.world_size == self.rank

    @dispatch("broadcast")
    def stream_sync(self, wanted: list[dict[str, Any]]) -> dict[str, int]:
        """Hold exactly the groups of ``wanted`` that belong to this rank (gid mod world size; each
        ``{"gid", "prompt", "seed"}``): start the new ones, forget the others
        (:meth:`GroupStreamer.sync`). Starts the streamer. Returns its counts."""
        return self._streamer().sync([w for w in wanted if self._mine(w["gid"])])

    @dispatch("broadcast")
    def stream_finished(self) -> list[dict[str, Any]]:
        """This rank's finished groups, in completion order (:meth:`GroupStreamer.finished`)."""
        return self._streamer().finished()

    @dispatch("broadcast")
    def stream_pop(self, gids: list[int]) -> list[dict[str, Any]]:
        """Hand out this rank's groups among ``gids`` (:meth:`GroupStreamer.pop`)."""
        return self._streamer().pop([g for g in gids if self._mine(g)])

    @dispatch("broadcast")
    def stream_stats(self, reset: bool = True) -> dict[str, float]:
        """The streamer's counters since the last call with ``reset`` (:meth:`GroupStreamer.take_stats`;
        ``reset=False`` reads them without resetting), the loaded version and the tokenizer's pad id."""
        stream = self._streamer()
        return {**(stream.take_stats() if reset else dict(stream.stats)), "weights_version": self.weights_version,
                "pad_id": int(self.tokenizer.pad_token_id)}

    # ---- versions and checkpoints ------------------------------------------------------------
    @dispatch("broadcast")
    def get_weights_version(self) -> int:
        """The weights_version this rank generates with."""
        return self.weights_version

    @dispatch("broadcast")
    def load_checkpoint(self, path: str) -> None:
        """Load the policy's weights and weights_version from checkpoint folder ``path`` (what the
        policy pool wrote: ``policy/`` HF folder, ``policy_optim/rank_0``); the inbox is emptied.
        Raises CheckpointError when files are missing."""
        root = Path(path)
        state = C.load_state(root / POLICY_OPTIM_DIR / "rank_0")
        if self.cfg.model.lora_rank > 0:
            weights = state["trainable"]
        else:
            weights = C.read_safetensors_folder(root / POLICY_DIR)
        with self._lock:
            version = int(state["versions"]["weights_version"])
            self._load_published(weights, version=version, where=str(root / POLICY_DIR))
            self.weights_version = version
            self._inbox.clear()


__all__ = ["RolloutWorker", "WeightsUnavailable"]
