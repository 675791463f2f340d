"""What a rollout engine supports beyond the four methods of :class:`workers.rollout.base.RolloutEngine`.

An engine declares its optional capabilities as a class attribute ``capabilities:
EngineCapabilities``; callers read them with :func:`engine_capabilities` and never probe the engine
(no ``hasattr(engine, ...)``, no ``inspect.signature(engine.generate)``;
``tests/unit/test_rollout_capabilities.py`` keeps such probes out of workers/, tasks/ and flows/).
An engine that declares nothing gets :data:`DEFAULT_CAPABILITIES`: the plain protocol, progress
reported once when ``generate`` returns, the trainer's merged weights through ``load_weights``.
The table of what hf and vllm declare is in docs/engines.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

WeightSyncMode = Literal["shared_module", "full_state_dict", "lora_adapter"]
WeightPush = Literal["none", "lora_adapter", "full_state_dict"]


@dataclass(frozen=True)
class EngineCapabilities:
    """An engine's optional capabilities; the defaults are those of an engine that declares nothing.

    continuing_kv: has ``generate_continuing(seqs, caches, sampling) -> (RolloutOutput, caches)``,
      the next turn of each sequence reusing its KV cache from the last turn (multi-turn rollouts
      use it when ``rollout.multi_turn.kv_cache``; otherwise each turn is a fresh ``generate``).
    progress: ``generate`` takes ``progress=`` (a ``(done, total)`` callback, :mod:`workers.progress`)
      and calls it as trajectories finish; False: the caller reports ``(n, n)`` once it returns.
    compiled_step: has ``compiled_step`` (a :class:`workers.rollout.compiled.CompiledDecodeStep`,
      or None when ``rollout.compile`` is off), whose compile counts become iteration metrics.
    fused_decode: has ``fused_decode_reason`` (None when its last single-turn call decoded fused,
      else why not), reported as the metric ``rollout/fused_decode``.
    partial_rollout_interrupt: ``generate`` takes ``interrupt=`` (``(new tokens so far) -> bool``,
      asked after each decode step) and, when it says True, returns the trajectories so far, the
      unfinished ones shorter than ``max_new_tokens`` (hf; vllm through its step loop, aborting the
      unfinished requests). The streaming rollout then decodes each response in one call until newer
      weights arrive; without it, one call per chunk.
    partial_rollout_pause: ``generate`` also takes ``pause=`` (``(unfinished rows) -> bool``): when
      ``interrupt`` says True it is called while the engine runs no step; it loads the new weights
      into this engine (through ``load_weights``) and returns True, and the unfinished requests
      continue in place on the KV cache they have (``rollout.partial: pause``; vllm, and hf in its own
      decode loop, which rebuilds its copies of the weights after the load: workers/rollout/hf_pause.py). The output's
      ``weight_epochs`` says which tokens came after which load. Needs ``partial_rollout_interrupt``.
    weight_sync: how the trainer's weights can reach the engine, one or more of
      "shared_module" (it generates on the module object ``from_config`` got as ``model``: the
      workers' inference module, so nothing is sent), "full_state_dict" (``load_weights`` of plain
      HF-named tensors, LoRA merged in), "lora_adapter" (``load_lora_adapter(tensors,
      peft_config, version)``: only the adapter; needs ``lora``).
    lora: generates a LoRA policy with its adapter unmerged (hf: on the peft module itself;
      vllm: ``enable_lora``). False: with LoRA it gets merged weights.
    Raises ValueError for an empty or unknown ``weight_sync`` mode, "lora_adapter" without ``lora``,
    or ``partial_rollout_pause`` without ``partial_rollout_interrupt``.
    """

    continuing_kv: bool = False
    progress: bool = False
    compiled_step: bool = False
    fused_decode: bool = False
    partial_rollout_interrupt: bool = False
    partial_rollout_pause: bool = False
    weight_sync: frozenset[WeightSyncMode] = field(default_factory=lambda: frozenset({"full_state_dict"}))
    lora: bool = False

    def __post_init__(self) -> None:
        modes = frozenset(self.weight_sync)
        object.__setattr__(self, "weight_sync", modes)
        unknown = sorted(modes - set(get_args(WeightSyncMode)))
        if not modes or unknown:
            raise ValueError(f"weight_sync {sorted(modes)}: give one or more of {list(get_args(WeightSyncMode))}")
        if "lora_adapter" in modes and not self.lora:
            raise ValueError("weight_sync 'lora_adapter' needs lora=True")
        if self.partial_rollout_pause and not self.partial_rollout_interrupt:
            raise ValueError("partial_rollout_pause needs partial_rollout_interrupt=True")

    @property
    def partial_modes(self) -> tuple[str, ...]:
        """The ``rollout.partial`` modes this engine offers under ``trainer.async_mode: stream``:
        "abort" and "off" on every engine (the streamer re-prefills a prefix through ``generate``),
        "pause" with ``partial_rollout_pause``. hybridflow.config's ``STREAM_PARTIAL_MODES`` mirrors it."""
        return ("abort", "pause", "off") if self.partial_rollout_pause else ("abort", "off")

    @property
    def shares_module(self) -> bool:
        """The engine generates on the workers' inference module itself: no weights to send."""
        return "shared_module" in self.weight_sync


DEFAULT_CAPABILITIES = EngineCapabilities()


def engine_capabilities(engine: Any) -> EngineCapabilities:
    """The capabilities ``engine`` declares (its ``capabilities`` attribute), else the defaults.

    The one place that looks for the declaration. Raises TypeError when ``capabilities`` is not
    an :class:`EngineCapabilities`.
    """
    caps = getattr(engine, "capabilities", DEFAULT_CAPABILITIES)
    if not isinstance(caps, EngineCapabilities):
        raise TypeError(f"{type(engine).__name__}.capabilities is {type(caps).__name__}, not EngineCapabilities")
    return caps


def weight_push(caps: EngineCapabilities, *, lora: bool) -> WeightPush:
    """How a worker gives the engine the trainer's current weights.

    "none" when the engine shares the inference module; with ``lora`` (``model.lora_rank > 0``)
    "lora_adapter" when the engine takes adapters; else "full_state_dict" (merged HF-named
    weights). Raises ValueError when the engine accepts none of these.
    """
    if caps.shares_module:
        return "none"
    if lora and "lora_adapter" in caps.weight_sync:
        return "lora_adapter"
    if "full_state_dict" in caps.weight_sync:
        return "full_state_dict"
    raise ValueError(f"the engine takes weights only as {sorted(caps.weight_sync)}, not a full state dict")


__all__ = [
    "DEFAULT_CAPABILITIES",
    "EngineCapabilities",
    "WeightPush",
    "WeightSyncMode",
    "engine_capabilities",
    "weight_push",
]
