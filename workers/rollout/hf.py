"""The transformers rollout engine (``rollout.engine: hf``) on the trainer's own model object.

Two decode paths, the same sampling and the same results up to float rounding:

* single-turn calls (:meth:`HFRolloutEngine.generate`) run the engine's own decode loop
  (:func:`workers.rollout.decode.decode`): each distinct prompt is prefilled once, a row leaves
  the batch and its KV cache when it finishes, and on a CPU a Llama-family model decodes through
  :class:`workers.rollout.fused_decode.FusedDecoder` (``rollout.fused_decode``), other models
  through their forward on oneDNN-packed linears (``rollout.packed_weights``) or a compiled step
  (``rollout.compile``);
* multi-turn calls (:meth:`HFRolloutEngine.generate_continuing`, continuing each trajectory's
  KV cache, :mod:`workers.rollout.kv_cache`) and ``rollout.drop_finished_rows: false`` run
  transformers' ``generate`` with :class:`workers.rollout.hf_sampler.RolloutSampler` as its only
  logits processor, under a clean GenerationConfig (the model's own, which may ask for sampling
  or penalties, is swapped out for the call).

Sampling (:func:`workers.rollout.decode_step.pick_tokens`) applies temperature, top-k and top-p and
picks by inverse-CDF sampling with uniforms drawn up front from a ``torch.Generator(seed)``: row
r of the call uses row r of that table, so results depend only on (seed, prompts, weights), not
on how rows are chunked into ``generation_batch_trajectories``, and the global RNG is untouched.
The log-prob recorded is log softmax(logits / T) of the *full* distribution (before top-k /
top-p), what the trainer recomputes; greedy uses T = 1. Positions come from the attention mask,
so left padding does not change a sequence's tokens or log-probs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from hybridflow.algorithms.sequences import position_ids_from_mask
from workers.progress import Tick
from workers.rollout.base import (
    EngineCapabilities,
    NamedTensors,
    RolloutOutput,
    SamplingParams,
    finalize_responses,
    register_rollout_engine,
    right_pad,
)
from workers.rollout.compiled import CompiledDecodeStep
from workers.rollout.decode import decode, top_k_top_p_filter
from workers.rollout.finished_rows import FinishedRows
from workers.rollout.fused_decode import FusedDecoder, why_not_fused_engine
from workers.rollout.hf_pause import InPlacePause
from workers.rollout.hf_sampler import Interrupt, RolloutSampler, clean_generation_config
from workers.rollout.kv_cache import KVCache, ready_cache
from workers.rollout.packed_weights import packed_linears, packs
from workers.shared_prefix import forward_kwargs, shared_prompt_cache, unwrapped


@register_rollout_engine("hf")
class HFRolloutEngine:
    """Generation with transformers on the trainer's own model object (the hybrid engine).

    model: a causal LM (or peft model) on its device; tokenizer: gives the pad id.
    generation_batch_trajectories: rows per decode batch (a memory knob; outputs do not
    depend on it). drop_finished_rows: decode with :func:`workers.rollout.decode.decode`, where a
    row leaves the batch and its KV cache when it finishes (default); False runs transformers'
    ``generate``, which computes every row until the longest finishes. The model is put in eval
    mode for generation and its previous mode restored. ``decode_stats`` holds the decode work of
    the last :meth:`generate` call: rows fed summed over steps (``row_steps``) and Σ response
    lengths (``useful_row_steps``). compile: run each decode step of that loop compiled on a
    static KV cache (:mod:`workers.rollout.compiled`, ``rollout.compile``); requires
    drop_finished_rows. The compiled graphs and caches live as long as the engine (once per pool);
    ``compile_stats`` gives the shapes compiled so far and their first-call seconds.
    packed_weights: on a CPU, decode on oneDNN-packed float32 linear weights, packed once per
    call (:mod:`workers.rollout.packed_weights`, ``rollout.packed_weights``); not with compile.
    ``packed_linears`` is the number of linears the last call packed. fused_decode: with
    drop_finished_rows on a CPU, Llama-family models prefill and decode single-turn calls through
    :class:`workers.rollout.fused_decode.FusedDecoder` (prepared once per call, instead of packing
    the linears; ``rollout.fused_decode``); ``fused_decode_reason`` is None when the last call ran
    fused, else why it did not. ``capabilities``: continuing KV (:meth:`generate_continuing`),
    progress, compiled step, fused decode, partial-rollout interrupt (``generate(interrupt=)``) and
    pause in place (``generate(pause=)``, :mod:`workers.rollout.hf_pause`); it generates on the module it was built with (the
    workers' inference module: "shared_module"), a peft one included (LoRA), and ``load_weights``
    copies a full state dict. dtype: what it generates in (``rollout.dtype``; None = the model's
    weights'): bfloat16 against a float32 model decodes fused in bfloat16 (weights, KV cache), else on
    bfloat16-packed linears, else under autocast; log-probs stay float32 (issue 41).
    """

    capabilities = EngineCapabilities(
        continuing_kv=True, progress=True, compiled_step=True, fused_decode=True, partial_rollout_interrupt=True,
        partial_rollout_pause=True, weight_sync=frozenset({"shared_module", "full_state_dict"}), lora=True,
    )  # fmt: skip

    def __init__(self, model: nn.Module, tokenizer: Any, *, generation_batch_trajectories: int = 64,
                 drop_finished_rows: bool = True, compile: bool = False,
                 packed_weights: bool = True, fused_decode: bool = True,
                 dtype: str | torch.dtype | None = None) -> None:  # fmt: skip
        if tokenizer.pad_token_id is None:
            raise ValueError("tokenizer has no pad token; use hybridflow.models.prepare_tokenizer")
        self.model = model
        self.dtype: torch.dtype | None = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.pad_token_id = int(tokenizer.pad_token_id)
        self.generation_batch_trajectories = generation_batch_trajectories
        self.drop_finished_rows = drop_finished_rows
        if compile and not drop_finished_rows:
            raise ValueError("rollout.compile needs rollout.drop_finished_rows=true (it compiles the engine's own decode loop)")
        self.compiled_step = CompiledDecodeStep(model) if compile else None
        self.packed_weights = packed_weights and not compile
        self.packed_linears = 0
        self.fused_decode = fused_decode and drop_finished_rows and not compile
        self._fused_off = ("rollout.fused_decode is false" if not fused_decode
                           else "rollout.compile is on (the compiled step decodes)" if compile
                           else "rollout.drop_finished_rows is false (transformers' generate decodes)")  # fmt: skip
        self.fused_decode_reason: str | None = "no call yet"
        self._fused: FusedDecoder | None = None
        self.decode_stats = {"row_steps": 0, "useful_row_steps": 0}

    @classmethod
    def from_config(cls, *, model: nn.Module, tokenizer: Any, model_cfg: Any, rollout_cfg: Any, device: Any = None):
        return cls(model, tokenizer, generation_batch_trajectories=rollout_cfg.generation_batch_trajectories,
                   drop_finished_rows=rollout_cfg.drop_finished_rows, compile=rollout_cfg.compile,
                   packed_weights=rollout_cfg.packed_weights, fused_decode=rollout_cfg.fused_decode,
                   dtype=None if rollout_cfg.dtype == "auto" else rollout_cfg.dtype)

    @property
    def compile_stats(self) -> dict[str, float]:
        """{"compiles": shapes compiled, "compile_seconds": their first calls' wall seconds}
        (zeros without ``compile``)."""
        step = self.compiled_step
        return {"compiles": step.compiles if step else 0, "compile_seconds": step.compile_seconds if step else 0.0}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, sampling: SamplingParams,
                 progress: Tick | None = None, interrupt: Callable[[int], bool] | None = None,
                 pause: Callable[[int], bool] | None = None) -> RolloutOutput:
        """B left-padded prompts → B*n trajectories (prompt-major). See RolloutOutput for shapes.
        progress: called with (trajectories finished, B*n) as rows stop (:class:`FinishedRows`)
        and after each chunk of ``generation_batch_trajectories`` rows. interrupt(k): asked after
        the k-th new token of each chunk of rows while some are unfinished; True ends that chunk
        there, its unfinished rows keeping the k tokens they have (no stop token, finish_reason
        "length" though shorter than ``max_new_tokens``: the caller, which asked, knows). The
        capability ``partial_rollout_interrupt``; the streaming rollout (:mod:`workers.group_stream`)
        uses it to keep decoding on one KV cache until newer weights arrive. pause(unfinished): asked
        when interrupt says True; it loads new weights into the model in place and True lets the
        chunk's rows go on, on their KV cache, every derived weight form refreshed
        (:class:`workers.rollout.hf_pause.InPlacePause`; ``weight_epochs`` set). ValueError where pause
        cannot run (transformers' generate path)."""
        if prompt_ids.shape != prompt_mask.shape or prompt_ids.dim() != 2:
            raise ValueError(f"prompt_ids {tuple(prompt_ids.shape)} and prompt_mask {tuple(prompt_mask.shape)}")
        empty = (~prompt_mask.bool().any(1)).nonzero().flatten().tolist() if prompt_ids.shape[1] else list(range(len(prompt_ids)))
        if empty:
            raise ValueError(f"prompt rows {empty[:8]}{' ...' if len(empty) > 8 else ''} have no real token "
                             "(prompt_mask all False); every prompt needs at least one token")
        rows = prompt_ids.shape[0] * sampling.n
        paused = None if pause is None else InPlacePause(self, interrupt, pause)
        row_prompt = torch.arange(prompt_ids.shape[0]).repeat_interleave(sampling.n)  # trajectory → prompt
        uniforms = None
        if not sampling.greedy:
            seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, ()).item())
            gen = torch.Generator().manual_seed(seed)
            uniforms = torch.rand(rows, sampling.max_new_tokens, generator=gen)
        outputs = []
        self.decode_stats = {"row_steps": 0, "useful_row_steps": 0}
        with self._generating(rows, fused=True):
            for start in range(0, rows, self.generation_batch_trajectories):
                chunk = row_prompt[start : start + self.generation_batch_trajectories]
                chunk_u = None if uniforms is None else uniforms[start : start + len(chunk)]
                counter = None if progress is None else FinishedRows(sampling.stop_token_ids, progress, start, rows)
                outputs.append(self._generate_chunk(prompt_ids, prompt_mask.bool(), chunk, sampling, chunk_u, counter,
                                                    interrupt, paused))  # fmt: skip
                if progress is not None:
                    progress(start + len(chunk), rows)
        return RolloutOutput(
            right_pad([o.response_ids for o in outputs], self.pad_token_id),
            right_pad([o.response_mask for o in outputs], False),
            right_pad([o.rollout_log_probs for o in outputs], 0.0),
            [r for o in outputs for r in o.finish_reason],
            None if paused is None else right_pad([o.weight_epochs for o in outputs], 0),
        )

    def _generate_chunk(
        self, prompt_ids: Tensor, prompt_mask: Tensor, row_prompt: Tensor, sampling: SamplingParams,
        uniforms: Tensor | None, counter: FinishedRows | None = None,
        interrupt: Callable[[int], bool] | None = None, paused: InPlacePause | None = None,
    ) -> RolloutOutput:
        """Trajectories ``row_prompt`` (prompt index per row) in one ``generate`` call."""
        unique, inverse = torch.unique_consecutive(row_prompt, return_inverse=True)
        ids, mask = prompt_ids[unique], prompt_mask[unique]
        real_cols = mask.any(0).nonzero()
        first = int(real_cols[0]) if len(real_cols) else 0
        ids, mask = ids[:, first:].to(self.device), mask[:, first:].to(self.device)  # drop all-pad columns
        prompt_len = ids.shape[1]
        inverse = inverse.to(self.device)
        if self.drop_finished_rows and forward_kwargs(self.model)[0] is not None:
            with torch.no_grad():
                on_finished = None if counter is None else (lambda k: counter.tick(counter.offset + k, counter.total))
                extra, steps = {}, self._fused
                if paused is not None:
                    paused.start_chunk()
                if steps is not None:  # each distinct prompt prefilled once, inside the fused decoder
                    steps.prefill(ids, mask, inverse, sampling.max_new_tokens)
                else:
                    extra = self._shared_prompt_cache(ids, mask, inverse)
                res = decode(self.model, ids[inverse], mask[inverse], sampling,
                             None if uniforms is None else uniforms.to(self.device), self.pad_token_id,
                             prefix_cache=extra, on_finished=on_finished, step=self.compiled_step,
                             steps=steps, interrupt=interrupt if paused is None else paused.interrupt, pause=paused)
            self._count_decode(res.row_steps, res.useful_row_steps)
            out = finalize_responses(res.response_ids.cpu(), res.log_probs.cpu(), sampling.stop_token_ids, self.pad_token_id)
            return out if paused is None else paused.with_epochs(out)
        sampler = RolloutSampler(sampling, prompt_len, uniforms)
        config = GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            do_sample=False,
            num_beams=1,
            use_cache=True,
            eos_token_id=list(sampling.stop_token_ids) or None,
            pad_token_id=self.pad_token_id,
        )
        with clean_generation_config(self.model), torch.no_grad():
            extra = self._shared_prompt_cache(ids, mask, inverse)
            seqs = self.model.generate(
                input_ids=ids[inverse],
                attention_mask=mask[inverse].long(),
                generation_config=config,
                logits_processor=LogitsProcessorList([sampler]),
                stopping_criteria=StoppingCriteriaList(
                    ([counter] if counter is not None else []) + ([Interrupt(interrupt, prompt_len)] if interrupt else [])),
                **extra,
            )
        response = seqs[:, prompt_len:].cpu()
        log_probs = sampler.log_probs(response.to(self.device)).cpu()
        out = finalize_responses(response, log_probs, sampling.stop_token_ids, self.pad_token_id)
        self._count_decode(response.shape[0] * response.shape[1], int(out.response_mask.sum()))
        return out

    @contextmanager
    def _generating(self, rows: int, fused: bool = False) -> Iterator[None]:
        """The model in eval mode for one generate call (its mode restored after); with ``fused``
        (single-turn calls) a :class:`FusedDecoder` when ``fused_decode`` and the model allows it,
        else its linears on packed weights when ``packed_weights`` (``packed_linears`` set to the
        number packed). The fused decoder's weight copies and KV cache are dropped on exit."""
        was_training = self.model.training
        self.model.eval()
        hint = self._pack_hint = min(rows, self.generation_batch_trajectories)  # (InPlacePause repacks with it)
        if not fused:
            self.fused_decode_reason = "multi-turn calls (generate_continuing) decode with transformers' generate"
        elif not self.fused_decode:
            self.fused_decode_reason = self._fused_off
        else:
            self.fused_decode_reason = why_not_fused_engine(self.model) or self._why_not_fused_dtype()
        try:
            if fused and self.fused_decode and self.fused_decode_reason is None:
                with torch.no_grad():  # why_not_fused_engine has checked the model
                    self._fused = FusedDecoder(unwrapped(self.model), hint, self.dtype)
                self.packed_linears = 0
                yield
                return
            cast = self._cast_dtype()
            with ExitStack() as stack:
                if self.packed_weights:
                    self.packed_linears = stack.enter_context(packed_linears(self.model, hint, cast))
                if cast is not None and not (self.packed_weights and self.packed_linears):
                    stack.enter_context(torch.autocast(self.device.type, dtype=cast))
                yield
        finally:
            self._fused = None
            self.model.train(was_training)

    def _why_not_fused_dtype(self) -> str | None:
        """Why the fused decoder cannot run in the decode dtype here (None: it can): it packs its
        weights with oneDNN, which packs bfloat16 only on CPUs with avx512bw/vl/dq or avx_ne_convert."""
        dtype = self.dtype or next(self.model.parameters()).dtype
        if packs(dtype):
            return None
        return f"this CPU's oneDNN cannot pack {str(dtype).removeprefix('torch.')} weights (needs avx512bw/vl/dq or avx_ne_convert)"

    def _cast_dtype(self) -> torch.dtype | None:
        """``dtype`` where it differs from the model's weights' (the products run in it), else None."""
        weights = next(self.model.parameters()).dtype
        return None if self.dtype is None or self.dtype == weights else self.dtype

    def _count_decode(self, row_steps: int, useful: int) -> None:
        self.decode_stats["row_steps"] += row_steps
        self.decode_stats["useful_row_steps"] += useful

    # ---- multi-turn: continue each trajectory's KV cache across turns ---------------------------
    def generate_continuing(
        self, seqs: list[list[int]], caches: list[KVCache | None], sampling: SamplingParams
    ) -> tuple[RolloutOutput, list[KVCache | None]]:
        """The next turn of each sequence (token ids, unpadded), reusing its KV cache from the last turn.

        caches[r]: what this method returned for sequence r last time (its first ``valid`` tokens
        are still ``seqs[r]``'s), or None. Rows are left padded into one ``generate`` call per chunk
        of ``generation_batch_trajectories``; the positions every row has cached (or padded) are
        given to ``generate`` as a ready cache, so only the rest is prefilled. Same tokens and
        log-probs as :meth:`generate` on the same padded rows, up to float rounding. ``sampling.n``
        must be 1. Returns (output, new caches): the new cache of row r covers its sequence and
        all but the last generated token.
        """
        if sampling.n != 1:
            raise ValueError(f"generate_continuing takes one sample per sequence, got n={sampling.n}")
        uniforms = None
        if not sampling.greedy:
            seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, ()).item())
            uniforms = torch.rand(len(seqs), sampling.max_new_tokens, generator=torch.Generator().manual_seed(seed))
        outputs, new_caches = [], []
        with self._generating(len(seqs)):
            for start in range(0, len(seqs), self.generation_batch_trajectories):
                end = start + self.generation_batch_trajectories
                out, kv = self._continue_chunk(seqs[start:end], caches[start:end], sampling,
                                               None if uniforms is None else uniforms[start:end])  # fmt: skip
                outputs.append(out)
                new_caches += kv
        joined = RolloutOutput(
            right_pad([o.response_ids for o in outputs], self.pad_token_id),
            right_pad([o.response_mask for o in outputs], False),
            right_pad([o.rollout_log_probs for o in outputs], 0.0),
            [r for o in outputs for r in o.finish_reason],
        )
        return joined, new_caches

    def _continue_chunk(self, seqs: list[list[int]], caches: list[KVCache | None], sampling: SamplingParams,
                        uniforms: Tensor | None) -> tuple[RolloutOutput, list[KVCache | None]]:  # fmt: skip
        width = max(len(s) for s in seqs)
        pads = [width - len(s) for s in seqs]
        ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.int64)
        for r, s in enumerate(seqs):
            ids[r, pads[r] :] = torch.tensor(s, dtype=torch.int64)
        mask = ids.new_ones(ids.shape, dtype=torch.bool)
        for r, p in enumerate(pads):
            mask[r, :p] = False
        ids, mask = ids.to(self.device), mask.to(self.device)
        cut = min(width - 1, *(p + (c.valid if c is not None else 0) for p, c in zip(pads, caches, strict=True)))
        extra = ready_cache(self.model, caches, pads, cut) if cut > 0 else {}
        sampler = RolloutSampler(sampling, width, uniforms)
        config = GenerationConfig(max_new_tokens=sampling.max_new_tokens, do_sample=False, num_beams=1, use_cache=True,
                                  eos_token_id=list(sampling.stop_token_ids) or None, pad_token_id=self.pad_token_id,
                                  return_dict_in_generate=True)  # fmt: skip
        with clean_generation_config(self.model), torch.no_grad():
            gen = self.model.generate(input_ids=ids, attention_mask=mask.long(), generation_config=config,
                                      logits_processor=LogitsProcessorList([sampler]), **extra)  # fmt: skip
        response = gen.sequences[:, width:].cpu()
        out = finalize_responses(response, sampler.log_probs(response.to(self.device)).cpu(),
                                 sampling.stop_token_ids, self.pad_token_id)  # fmt: skip
        cache = getattr(gen, "cache", None) or getattr(gen, "past_key_values", None)
        layers = getattr(cache, "layers", None)
        if not layers or not hasattr(layers[0], "keys"):
            return out, [None] * len(seqs)
        kept = out.response_mask.sum(-1).tolist()
        new = []
        for r, p in enumerate(pads):
            end = min(width + int(kept[r]) - 1, layers[0].keys.shape[2])
            kv = [(lay.keys[r, :, p:end].clone(), lay.values[r, :, p:end].clone()) for lay in layers]
            new.append(KVCache(kv, end - p))
        return out, new

    def _shared_prompt_cache(self, ids: Tensor, mask: Tensor, inverse: Tensor) -> dict[str, Any]:
        """Prefill each distinct prompt once and give every trajectory a copy of its KV cache.

        ``generate`` with n samples per prompt would run the prompt's forward pass n times (it
        expands the inputs before prefill); here the prompts minus their last token go through
        the model once ([P, L-1]), the cache rows are gathered per trajectory, and ``generate``
        starts from that cache (its first step feeds the last prompt token). Same positions
        (from the attention mask) and the same attention, so the same tokens and log-probs up to
        float rounding. Returns the ``generate`` kwargs ({} when no prompt repeats, or the
        prompts are one token long or end in padding).
        """
        if len(inverse) == ids.shape[0] or ids.shape[1] < 2 or not bool(mask[:, -1].all()):
            return {}
        prefix_mask = mask[:, :-1]
        return shared_prompt_cache(self.model, ids[:, :-1], prefix_mask, position_ids_from_mask(prefix_mask), inverse)

    # ---- weights -------------------------------------------------------------------------------
    def load_weights(self, named_tensors: NamedTensors) -> None:
        """Copy weights into the engine's model in place (plain HF names, or the model's own).

        A tensor that already is the engine's parameter (the hybrid engine: trainer and engine
        share one module) is skipped, so this is a no-op there. Raises KeyError for an unknown name.
        """
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        params = _weights_by_name(self.model)
        with torch.no_grad():
            for name, tensor in items:
                if name not in params:
                    raise KeyError(f"load_weights: the engine's model has no weight {name!r}")
                target = params[name]
                if target.data_ptr() != tensor.data_ptr():
                    target.copy_(tensor.to(device=target.device, dtype=target.dtype))

    def sleep(self) -> None:
        """No-op: transformers keeps no KV cache between ``generate`` calls."""

    def wake_up(self) -> None:
        """No-op (see :meth:`sleep`)."""


def _weights_by_name(model: nn.Module) -> dict[str, Tensor]:
    """The model's tensors by state-dict name, plus plain HF aliases for a peft model's base weights."""
    out = dict(model.state_dict(keep_vars=True))
    if hasattr(model, "get_base_model"):
        for name, t in model.get_base_model().state_dict(keep_vars=True).items():
            if ".lora_" not in name:
                out.setdefault(name.replace(".base_layer.", "."), t)
    return out


__all__ = ["HFRolloutEngine", "top_k_top_p_filter"]
