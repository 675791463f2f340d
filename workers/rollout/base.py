"""The rollout-engine protocol: what every generation backend (hf, vllm) takes and returns.

Rows are trajectories, prompt-major: prompt i's ``n`` samples are rows ``i*n .. i*n+n-1``,
the order of ``Batch.repeat_interleave(n)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor

from hybridflow.algorithms.sequences import response_mask_from_ids
from hybridflow.registry import Registry
from workers.rollout.capabilities import DEFAULT_CAPABILITIES, EngineCapabilities, engine_capabilities  # noqa: F401  (re-exported)

FinishReason = Literal["stop", "length", "max_turns", "env_done", "env_error"]  # the last three: multi-turn
NamedTensors = Iterable[tuple[str, Tensor]] | Mapping[str, Tensor]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. temperature 0 = greedy (top_p / top_k ignored).

    top_k ≤ 0 and top_p = 1 disable those filters. stop_token_ids: a response ends at the
    first of them (included in the response); callers pass the tokenizer's EOS here
    (:func:`sampling_params_from_config` does). n: samples per prompt. seed: the same seed,
    prompts and weights give the same samples; None draws a seed from torch's global RNG.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be ≥ 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be ≥ 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.n < 1:
            raise ValueError(f"n must be ≥ 1, got {self.n}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """The T of the reported log-probs, log softmax(logits / T): the sampling temperature, 1 when greedy."""
        return 1.0 if self.greedy else self.temperature


@dataclass
class RolloutOutput:
    """What an engine returns for B prompts × n samples (rows prompt-major).

    response_ids: [B*n, R] int64, right padded with the pad id.
    response_mask: [B*n, R] bool, True up to and including the first stop token.
    rollout_log_probs: [B*n, R] float32 nats, log softmax(logits / T)[token] of the full
      (unfiltered) distribution at the sampling temperature (T = 1 for greedy); 0 outside the mask.
    finish_reason: B*n of "stop" (a stop token ended it) | "length" (max_new_tokens reached).
    weight_epochs: None, or [B*n, R] int64 when the call paused in place to load new weights
      (``generate(pause=...)``, capability ``partial_rollout_pause``): per token, how many of those
      loads came before it was sampled (0 = the weights the call started with); 0 outside the mask.
    """

    response_ids: Tensor
    response_mask: Tensor
    rollout_log_probs: Tensor
    finish_reason: list[FinishReason] = field(default_factory=list)
    weight_epochs: Tensor | None = None

    def __post_init__(self) -> None:
        shape = tuple(self.response_ids.shape)
        checks = {
            "response_ids": (self.response_ids, torch.int64),
            "response_mask": (self.response_mask, torch.bool),
            "rollout_log_probs": (self.rollout_log_probs, torch.float32),
        }
        if self.weight_epochs is not None:
            checks["weight_epochs"] = (self.weight_epochs, torch.int64)
        for name, (t, dtype) in checks.items():
            if t.dim() != 2 or tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"{name}: {tuple(t.shape)} {t.dtype}; expected {shape} {dtype}")
        if len(self.finish_reason) != shape[0]:
            raise ValueError(f"finish_reason has {len(self.finish_reason)} entries for {shape[0]} rows")

    def __len__(self) -> int:
        return int(self.response_ids.shape[0])

    def tensors(self) -> dict[str, Tensor]:
        """The batch-contract tensors (``Batch.from_dict(out.tensors(), {"finish_reason": ...})``)."""
        return {
            "response_ids": self.response_ids,
            "response_mask": self.response_mask,
            "rollout_log_probs": self.rollout_log_probs,
        }


@runtime_checkable
class RolloutEngine(Protocol):
    """A generation backend. ``generate`` takes left-padded prompts; weights come in by ``load_weights``.

    Optional capabilities are declared, not probed: a class attribute ``capabilities:
    EngineCapabilities`` (:mod:`workers.rollout.capabilities`: continuing a conversation's KV,
    progress reporting, compiled step, fused decode, partial-rollout interrupt, weight-sync modes,
    LoRA), read by callers through :func:`engine_capabilities`. An engine that declares nothing
    gets ``DEFAULT_CAPABILITIES`` (none of them; weights as a full state dict). ``capabilities`` is
    not a structural member here, so such an engine still is a RolloutEngine.
    """

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, sampling: SamplingParams) -> RolloutOutput:
        """prompt_ids [B, P] int64 left padded, prompt_mask [B, P] bool → B*n trajectories.
        An engine declaring ``capabilities.progress`` also takes ``progress=`` (a ``(done, total)``
        callback, :mod:`workers.progress`) and calls it as trajectories finish; for any other
        engine the caller reports once, at the end."""
        ...

    def load_weights(self, named_tensors: NamedTensors) -> None:
        """Make the engine generate with these weights (plain HF parameter names)."""
        ...

    def sleep(self) -> None:
        """Free generation memory between rollouts (colocated engines); a no-op where there is none."""
        ...

    def wake_up(self) -> None:
        """Undo :meth:`sleep` before the next ``generate`` / ``load_weights``."""
        ...


# ---- registry --------------------------------------------------------------------------------
def _import_builtins() -> None:
    import workers.rollout.hf  # noqa: F401  (registers "hf")
    import workers.rollout.vllm  # noqa: F401  (registers "vllm"; vllm itself is imported lazily)


# ``rollout.engine=name``: a class providing ``from_config(*, model, tokenizer, model_cfg, rollout_cfg,
# device)``. Registering a taken name raises DuplicateNameError (a ValueError); an unknown name
# raises UnknownNameError (a KeyError) listing the known ones.
ROLLOUT_ENGINES: Registry[Callable[..., Any]] = Registry("rollout engine", builtins=_import_builtins)
register_rollout_engine = ROLLOUT_ENGINES.register
get_rollout_engine = ROLLOUT_ENGINES.get
rollout_engine_names = ROLLOUT_ENGINES.names


def build_engine(cfg: Any, *, model: Any, tokenizer: Any, device: Any) -> Any:
    """The rollout engine ``cfg.rollout.engine`` of an experiment config, for a worker holding the
    (unsharded) inference module ``model``: the policy and the rollout pool build theirs the same way.
    The engine's ``rollout_cfg`` carries the resolved ``dtype`` and ``max_model_len``
    (:attr:`hybridflow.config.ExperimentConfig.rollout_dtype` / ``rollout_max_model_len``)."""
    rollout_cfg = cfg.rollout.model_copy(update={"dtype": cfg.rollout_dtype,
                                                 "max_model_len": cfg.rollout_max_model_len})
    return get_rollout_engine(cfg.rollout.engine).from_config(
        model=model, tokenizer=tokenizer, model_cfg=cfg.model, rollout_cfg=rollout_cfg, device=device)


# ---- helpers shared by engines ------------------------------------------------------------------
def sampling_params_from_config(
    rollout_cfg: Any, stop_token_ids: Sequence[int], *, validation: bool = False, seed: int | None = None
) -> SamplingParams:
    """SamplingParams from a ``RolloutConfig``: training (temperature, n = samples_per_prompt)
    or validation (val_temperature, val_samples_per_prompt). stop ids = ``stop_token_ids``
    (pass :func:`hybridflow.models.tokenizer_stop_ids`) + ``rollout_cfg.stop_token_ids``.
    """
    stops = tuple(dict.fromkeys([*stop_token_ids, *rollout_cfg.stop_token_ids]))
    return SamplingParams(
        max_new_tokens=rollout_cfg.max_response_tokens,
        temperature=rollout_cfg.val_temperature if validation else rollout_cfg.temperature,
        top_p=rollout_cfg.top_p,
        top_k=rollout_cfg.top_k,
        stop_token_ids=stops,
        n=rollout_cfg.val_samples_per_prompt if validation else rollout_cfg.samples_per_prompt,
        seed=seed,
    )


def finalize_responses(
    response_ids: Tensor, log_probs: Tensor, stop_token_ids: Sequence[int], pad_token_id: int
) -> RolloutOutput:
    """Mask, pad and label raw engine output.

    response_ids [N, R] int64 (tokens after the first stop are ignored), log_probs [N, R]
    float32. Positions after the first stop token become ``pad_token_id`` with log-prob 0;
    finish_reason is "stop" where a stop token occurs, else "length".
    """
    mask = response_mask_from_ids(response_ids, stop_token_ids)
    stopped = torch.isin(response_ids, torch.as_tensor(list(stop_token_ids), dtype=torch.int64)).any(-1)
    ids = response_ids.masked_fill(~mask, pad_token_id)
    lp = log_probs.float().masked_fill(~mask, 0.0)
    reasons: list[FinishReason] = ["stop" if s else "length" for s in stopped.tolist()]
    return RolloutOutput(ids, mask, lp, reasons)


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Token-id lists → (ids [B, W] int64 left padded with ``pad_id``, mask [B, W] bool), W the longest."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.as_tensor(r, dtype=torch.int64)
        mask[i, width - len(r):] = True
    return ids, mask


def right_pad(rows: Sequence[Tensor], value: float | int, width: int | None = None) -> Tensor:
    """Stack 2-D blocks [n_i, R_i] into [Σn_i, max R_i] (or ``width``), padding on the right."""
    width = max(r.shape[1] for r in rows) if width is None else width
    out = [torch.nn.functional.pad(r, (0, width - r.shape[1]), value=value) for r in rows]
    return torch.cat(out, 0)
