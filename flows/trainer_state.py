"""What a checkpoint holds for the driver: ``checkpoints/step_<k>/trainer_state.json``.

The workers' parts of a checkpoint (weights, optimizer, their RNG and ``weights_version``) are
written by the pools; this is the driver's part, read back on a resume. The JSON object has
exactly these keys (the format since the first checkpoint; old checkpoints resume as they are)::

    {"iteration": 7, "policy_version": 7, "critic_version": 7, "kl_coef": 0.001,
     "bad_updates_in_a_row": 0, "sampler": {...PromptSampler.state_dict()...},
     "mlflow_run_id": "4f2c..." | null,
     "rollouts": {"8": {"prompts": {...NodeResult...}, "rollout": {...RolloutResult...}}}}

``rollouts`` (asynchronous training only; absent or {} otherwise): the rollouts that were in flight
when the checkpoint was taken, by iteration (:mod:`flows.rollout_ahead`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from workers.checkpoint import TRAINER_STATE, CheckpointError, read_trainer_state

OPTIONAL_KEYS = frozenset({"mlflow_run_id", "rollouts"})  # read with a default (None / {}): older checkpoints lack them


class TrainerStateError(CheckpointError):
    """A trainer_state.json with a missing or unknown key, or a value of the wrong type (names
    the file and the key)."""


@dataclass
class TrainerState:
    """The driver's counters of one run, as a checkpoint saves them.

    iteration: the last RL iteration the state includes (0 before the first).
    policy_version / critic_version: updates applied to each trained role (the pools'
    ``weights_version``; the exactly-once check expects them).
    kl_coef: the KL coefficient the next iteration uses (the adaptive controller moves it).
    bad_updates_in_a_row: consecutive skipped (NaN/inf) policy updates, for ``trainer.max_bad_updates``.
    sampler: ``PromptSampler.state_dict()`` ({} until a checkpoint snapshot fills it).
    mlflow_run_id: the MLflow run a resume keeps logging to (None: not known yet).
    rollouts: the rollouts in flight at the checkpoint (asynchronous training; {} otherwise).
    published_version: the newest policy version published to the rollout pool (``trainer.updates_per_sync``);
    None: ``policy_version``. Not saved: an iteration that writes a checkpoint always publishes.
    """

    kl_coef: float
    iteration: int = 0
    policy_version: int = 0
    critic_version: int = 0
    bad_updates_in_a_row: int = 0
    sampler: dict[str, Any] = field(default_factory=dict)
    mlflow_run_id: str | None = None
    rollouts: dict[str, Any] = field(default_factory=dict)
    published_version: int | None = field(default=None, compare=False, metadata={"saved": False})

    @property
    def rollout_weights_version(self) -> int:
        """The policy version the rollout pool generates with next: the newest published one."""
        return self.policy_version if self.published_version is None else self.published_version

    def to_dict(self) -> dict[str, Any]:
        """The trainer_state.json object (JSON-serialisable; the sampler state is copied; ``rollouts``
        only when rollouts were in flight, so a synchronous run's file is the format it always was)."""
        return {
            "iteration": self.iteration,
            "policy_version": self.policy_version,
            "critic_version": self.critic_version,
            "kl_coef": self.kl_coef,
            "bad_updates_in_a_row": self.bad_updates_in_a_row,
            "sampler": dict(self.sampler),
            "mlflow_run_id": self.mlflow_run_id,
            **({"rollouts": dict(self.rollouts)} if self.rollouts else {}),  # only with rollouts in flight
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = TRAINER_STATE) -> TrainerState:
        """Inverse of :meth:`to_dict`. ``source`` names the file in errors.

        Raises TrainerStateError naming ``source`` and the key: a key other than the eight, a
        missing one (``mlflow_run_id`` may be absent: None), or a value of the wrong type."""
        if not isinstance(data, dict):
            raise TrainerStateError(f"{source}: expected a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls) if f.metadata.get("saved", True)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise TrainerStateError(f"{source}: unknown key {unknown[0]!r} (a trainer state has {sorted(names)})")
        missing = sorted(names - OPTIONAL_KEYS - set(data))
        if missing:
            raise TrainerStateError(f"{source}: missing key {missing[0]!r}")
        for key, kinds in _TYPES.items():
            value = data.get(key)
            if not isinstance(value, kinds) or isinstance(value, bool):
                raise TrainerStateError(f"{source}: key {key!r} is {value!r}, expected {kinds[0].__name__}")
        mlflow_run_id = data.get("mlflow_run_id")
        if mlflow_run_id is not None and not isinstance(mlflow_run_id, str):
            raise TrainerStateError(f"{source}: key 'mlflow_run_id' is {mlflow_run_id!r}, expected str or null")
        rollouts = data.get("rollouts") or {}
        if not isinstance(rollouts, dict):
            raise TrainerStateError(f"{source}: key 'rollouts' is {rollouts!r}, expected an object")
        return cls(**{**data, "sampler": dict(data["sampler"]), "mlflow_run_id": mlflow_run_id, "rollouts": rollouts})

    @classmethod
    def read(cls, step_dir: str | os.PathLike) -> TrainerState:
        """The trainer state of a committed checkpoint folder (``checkpoints/iter_000007``).
        Raises CheckpointError (missing or not JSON), TrainerStateError (keys, types)."""
        return cls.from_dict(read_trainer_state(step_dir), source=f"{step_dir}/{TRAINER_STATE}")


_TYPES: dict[str, tuple[type, ...]] = {
    "iteration": (int,), "policy_version": (int,), "critic_version": (int,), "kl_coef": (float, int),
    "bad_updates_in_a_row": (int,), "sampler": (dict,),
}

__all__ = ["TrainerState", "TrainerStateError", "OPTIONAL_KEYS"]
