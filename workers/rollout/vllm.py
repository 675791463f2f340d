"""The vLLM rollout engine: vLLM's offline ``LLM`` behind the rollout protocol (GPU, extra ``vllm``).

NOT RUN ON A REAL vLLM. vLLM cannot be installed where this was written (no GPU; the wheel
does not fit the GPU machine's transfer limit). The code follows the documented API of the
pinned version (``vllm==0.33.0``: ``LLM.generate`` with token prompts, ``SamplingParams``,
``RequestOutput`` / ``CompletionOutput`` / ``Logprob``, ``LLM.collective_rpc`` with a callable,
``LLM.sleep`` / ``wake_up`` / ``reset_prefix_cache``) and is tested against stand-ins of those
types (tests/unit/test_rollout_vllm.py). See docs/engines.md.

Conventions that match the HF engine:
* stops: exactly ``sampling.stop_token_ids`` (``ignore_eos=True`` so a model's extra EOS ids in
  its generation_config do not add stops the HF engine would not use);
* log-probs: ``logprobs=0`` returns the sampled token's log-prob; the engine is built with
  ``logprobs_mode="processed_logprobs"`` so they are on logits / T (vLLM's default
  "raw_logprobs" ignores temperature). With top-k / top-p, vLLM reports the *filtered,
  renormalised* distribution, which differs from the HF engine's full-distribution value;
  ``rollout/logprob_diff_max`` shows the gap;
* seeds: prompt i gets ``seed + i*n``; vLLM gives its j-th sample ``seed + i*n + j``.

LoRA (``model.lora_rank > 0``): vLLM is built with ``enable_lora=True`` and holds the base
weights it loaded from the folder, which never change; after every update the trainer's
adapter is written as a PEFT folder and each ``generate`` passes a ``LoRARequest`` for it
(:meth:`VLLMRolloutEngine.load_lora_adapter`), as verl does. Only the adapter crosses.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
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

DEFAULT_BUCKET_BYTES = 512 << 20
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vllm's LoRAConfig.max_lora_rank accepts


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
def _sampled_log_probs(completion: Any) -> list[float]:
    """The chosen tokens' log-probs from ``CompletionOutput.logprobs`` (list of {id: Logprob})."""
    if completion.logprobs is None:
        raise RuntimeError("vLLM returned no logprobs; the request must set logprobs=0")
    ids = list(completion.token_ids)
    if len(completion.logprobs) < len(ids):
        raise RuntimeError(f"vLLM returned {len(completion.logprobs)} logprob entries for {len(ids)} tokens")
    return [float(completion.logprobs[pos][tok].logprob) for pos, tok in enumerate(ids)]


def parse_request_outputs(
    outputs: Sequence[Any], sampling: SamplingParams, pad_token_id: int
) -> RolloutOutput:
    """``list[RequestOutput]`` (one per prompt, in prompt order) → a prompt-major RolloutOutput.

    Each RequestOutput holds ``n`` CompletionOutputs (ordered here by ``.index``). A response is
    cut after its first stop token; finish_reason is vLLM's ("stop" | "length"); anything else
    ("abort", None) raises RuntimeError.
    """
    ids_rows: list[list[int]] = []
    lp_rows: list[list[float]] = []
    reasons: list[FinishReason] = []
    for req in outputs:
        completions = sorted(req.outputs, key=lambda c: c.index)
        if len(completions) != sampling.n:
            raise RuntimeError(f"request {req.request_id}: {len(completions)} completions, expected n={sampling.n}")
        for c in completions:
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"request {req.request_id} sample {c.index} finished with {c.finish_reason!r}")
            ids_rows.append(list(c.token_ids))
            lp_rows.append(_sampled_log_probs(c))
            reasons.append(c.finish_reason)
    width = max([1, *(len(r) for r in ids_rows)])
    ids = torch.full((len(ids_rows), width), pad_token_id, dtype=torch.int64)
    lps = torch.zeros((len(ids_rows), width), dtype=torch.float32)
    for row, (r_ids, r_lp) in enumerate(zip(ids_rows, lp_rows, strict=True)):
        ids[row, : len(r_ids)] = torch.tensor(r_ids, dtype=torch.int64)
        lps[row, : len(r_lp)] = torch.tensor(r_lp, dtype=torch.float32)
    lengths = torch.tensor([len(r) for r in ids_rows])
    mask = response_mask_from_ids(ids, sampling.stop_token_ids, response_lengths=lengths)
    return RolloutOutput(ids.masked_fill(~mask, pad_token_id), mask, lps.masked_fill(~mask, 0.0), reasons)


# ---- weights -------------------------------------------------------------------------------------
def vllm_weight_name(name: str) -> str:
    """A trainer state-dict name → the HF name vLLM's ``model.load_weights`` expects.

    Strips FSDP / compile / peft wrappers (``_fsdp_wrapped_module.``, ``_orig_mod.``,
    ``base_model.model.``, ``.base_layer``). Raises ValueError for LoRA tensors: merge first
    (:func:`hybridflow.models.merged_named_tensors`).
    """
    if ".lora_" in name:
        raise ValueError(f"{name!r} is a LoRA tensor; pass merged weights (hybridflow.models.merged_named_tensors)")
    for prefix in ("_fsdp_wrapped_module.", "_orig_mod.", "module."):
        name = name.replace(prefix, "")
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def weight_buckets(named: Iterable[tuple[str, Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """Group (vLLM name, tensor) pairs into lists of at most ``bucket_bytes`` (one tensor may exceed it)."""
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((vllm_weight_name(name), t.detach()))
        size += nbytes
    if bucket:
        yield bucket


def load_weights_on_worker(worker: Any, weights: list[tuple[str, Tensor]]) -> int:
    """Runs inside each vLLM worker (sent by ``LLM.collective_rpc``): load HF-named tensors in place.

    ``worker.model_runner.model`` is vLLM's model; its ``load_weights`` maps HF names onto its
    fused / tensor-parallel parameters. Returns the number of tensors given.
    """
    worker.model_runner.model.load_weights(weights)
    return len(weights)


# ---- LoRA adapters -------------------------------------------------------------------------------
def vllm_max_lora_rank(lora_rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds ``lora_rank`` (e.g. 4 → 8, 16 → 16).
    Raises ValueError above 512 (vLLM's largest)."""
    for allowed in VLLM_MAX_LORA_RANKS:
        if lora_rank <= allowed:
            return allowed
    raise ValueError(f"model.lora_rank={lora_rank} is above vLLM's largest max_lora_rank {VLLM_MAX_LORA_RANKS[-1]}")


def write_peft_adapter(folder: Path, adapter_tensors: Mapping[str, Tensor], peft_config: Mapping[str, Any]) -> Path:
    """Write a PEFT adapter folder atomically: ``adapter_model.safetensors`` + ``adapter_config.json``.

    adapter_tensors: PEFT on-disk names (``base_model.model.….lora_A.weight``) → tensors (copied to
    CPU, contiguous); peft_config: the JSON of ``adapter_config.json`` (see
    :func:`hybridflow.models.lora_adapter_state`). Raises FileExistsError when ``folder`` exists;
    ValueError for a tensor that is not a ``lora_A`` / ``lora_B`` weight (base weights never go here).
    """
    from safetensors.torch import save_file

    from hybridflow.models.fsutil import atomic_directory

    bad = [n for n in adapter_tensors if ".lora_A." not in n and ".lora_B." not in n]
    if bad:
        raise ValueError(f"not LoRA adapter tensors: {bad[:3]}{' …' if len(bad) > 3 else ''}")
    with atomic_directory(folder) as tmp:
        save_file({n: t.detach().cpu().contiguous() for n, t in adapter_tensors.items()},
                  str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(dict(peft_config), indent=2, sort_keys=True))
    return folder


@register_rollout_engine("vllm")
class VLLMRolloutEngine:
    """Rollouts with vLLM's offline engine; weights synced in place from the trainer.

    llm: a ``vllm.LLM`` built with ``enable_sleep_mode=True`` and
    ``logprobs_mode="processed_logprobs"`` (:meth:`from_config` does). For colocation in one
    process set ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` before building it, so
    ``collective_rpc`` hands tensors to the worker without serialising them. ``capabilities``:
    weights as a full state dict (:meth:`load_weights`) or, with LoRA, the adapter only
    (:meth:`load_lora_adapter`); no continuing KV, no progress callback (the caller reports each
    call once, when it returns), no compiled step or fused decode of ours.
    """

    capabilities = EngineCapabilities(weight_sync=frozenset({"full_state_dict", "lora_adapter"}), lora=True)

    def __init__(self, llm: Any, *, pad_token_id: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.llm = llm
        self.pad_token_id = int(pad_token_id)
        self.bucket_bytes = bucket_bytes
        self.sleeping = False
        self.lora_request: Any = None  # vllm LoRARequest of the current adapter; None = base weights only
        self._lora_root: Path | None = None
        self._lora_loads = 0

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
    ) -> VLLMRolloutEngine:
        """Build ``vllm.LLM`` on the policy's HF folder (a GGUF's safetensors cache for GGUF models).

        ``model`` (the trainer's module) is not used here: vLLM loads its own copy, and the
        trainer's weights arrive through :meth:`load_weights`. With ``model_cfg.lora_rank > 0`` vLLM
        is built with ``enable_lora=True``, ``max_lora_rank`` = the rank rounded up to a value vLLM
        accepts and ``max_loras=1``; the adapter arrives through :meth:`load_lora_adapter`.
        """
        from vllm import LLM  # lazy: the GPU extra

        from hybridflow.models import hf_folder, resolve_model_path

        folder = str(hf_folder(resolve_model_path(model_cfg.path)))
        lora: dict[str, Any] = {}
        if model_cfg.lora_rank > 0:  # one adapter at a time: the trainer's current one
            lora = {"enable_lora": True, "max_lora_rank": vllm_max_lora_rank(model_cfg.lora_rank), "max_loras": 1}
        llm = LLM(
            model=folder,
            tokenizer=folder,
            dtype=model_cfg.dtype,
            seed=seed,
            tensor_parallel_size=rollout_cfg.tensor_parallel_size,
            gpu_memory_utilization=rollout_cfg.gpu_memory_utilization,
            enable_sleep_mode=True,
            logprobs_mode="processed_logprobs",
            max_model_len=max_model_len,
            **lora,
        )
        return cls(llm, pad_token_id=tokenizer.pad_token_id)

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, sampling: SamplingParams) -> RolloutOutput:
        """B left-padded prompts → B*n trajectories (prompt-major); see RolloutOutput."""
        from vllm import SamplingParams as VLLMSamplingParams

        if self.sleeping:
            self.wake_up()
        seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**31, ()).item())
        prompts, params = build_requests(prompt_ids, prompt_mask, sampling, VLLMSamplingParams, seed)
        lora = {"lora_request": self.lora_request} if self.lora_request is not None else {}
        outputs = self.llm.generate(prompts, sampling_params=params, use_tqdm=False, **lora)
        return parse_request_outputs(outputs, sampling, self.pad_token_id)

    def load_weights(self, named_tensors: NamedTensors) -> None:
        """Sync trainer weights into vLLM in place, in buckets of ``bucket_bytes``.

        Pass plain HF names (``merged_named_tensors(model)`` for LoRA). A sleeping engine wakes its
        weights first and its KV cache after; the prefix cache is reset (its KV came from old weights).
        """
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        was_sleeping = self.sleeping
        if was_sleeping:
            self.llm.wake_up(tags=["weights"])
        for bucket in weight_buckets(items, self.bucket_bytes):
            self.llm.collective_rpc(load_weights_on_worker, args=(bucket,))
        if was_sleeping:
            self.llm.wake_up(tags=["kv_cache"])
            self.sleeping = False
        self.llm.reset_prefix_cache()

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
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Level 1: weights offloaded to CPU, KV cache discarded (frees GPU memory for training)."""
        if not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = True

    def wake_up(self) -> None:
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False
