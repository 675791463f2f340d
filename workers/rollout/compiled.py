"""A compiled decode step for the hf engine (``rollout.compile``): a static KV cache and
``torch.compile`` of one decode forward.

The eager loop (:func:`workers.rollout.decode.decode`) grows a DynamicCache by one column per
step and shrinks its batch as rows finish, so every step has a new shape. Here each decode batch
runs on a transformers ``StaticCache`` of fixed shape ``[batch bucket, heads, length bucket,
head_dim]`` per layer, and the decode forward (input ``[bucket, 1]``, attention mask ``[bucket,
length]``) is compiled once per (bucket, length) and reused for every step, every chunk and every
iteration of the engine's life (the engine lives in its Ray actor, so once per pool):

- batch buckets: the chunk's row count, then the powers of two below it. Rows that finish keep
  their slot until the live rows fit the next smaller bucket; then the live rows (and their KV
  cache) move into that bucket's cache. Finished rows still in a bucket are computed and their
  output ignored (counted in ``row_steps``).
- length buckets: prompt width + max new tokens − 1, rounded up to ``length_multiple`` columns.
- caches are allocated once per shape and reused, so their addresses stay fixed (what CUDA graphs
  need: on CUDA the step is compiled with ``mode="reduce-overhead"``; on CPU with inductor's
  default mode).

``compiles`` counts the (batch, length, dtype, device) shapes this engine has met and
``compile_seconds`` sums the wall time of each one's first call (tracing + compiling + that
step). Dynamo's cache of compiled graphs is per process (keyed on the step's code), so a second
engine in the same process that meets a shape already compiled counts it, but its first call is
fast; inductor's on-disk cache also shortens compiles in later processes. The recompile limit
(``torch._dynamo.config.recompile_limit``) is raised to 256 for the process; past it, new shapes
run eagerly (correct, slower) with a logged warning. Prior art: transformers' ``generate`` with
``cache_implementation="static"`` and a compiled forward; gpt-fast (PyTorch labs).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import Tensor, nn

from hybridflow.algorithms.sequences import position_ids_from_mask
from workers.rollout.decode_step import DecodeResult, prefill, take_step, useful_row_steps
from workers.shared_prefix import forward_kwargs

log = logging.getLogger(__name__)


class CompiledDecodeStep:
    """One compiled decode forward of ``model`` over a StaticCache, with its caches.

    model: a transformers causal LM (or a peft model around one) whose forward takes a KV cache.
    length_multiple: cache lengths are rounded up to a multiple of this (fewer distinct shapes,
    so fewer compiles). Raises ValueError for a model whose forward takes no cache.
    """

    def __init__(self, model: nn.Module, *, length_multiple: int = 64) -> None:
        name, keep_last = forward_kwargs(model)
        if name is None:
            raise ValueError(f"rollout.compile: {type(model).__name__}.forward takes no KV cache argument")
        if length_multiple <= 0:
            raise ValueError(f"length_multiple must be positive, got {length_multiple}")
        self.model = model
        self.cache_name, self.keep_last = name, keep_last
        self.length_multiple = length_multiple
        self.compile_seconds = 0.0
        self.compiles = 0
        self._shapes: set[tuple[int, int, str, str]] = set()  # (rows, columns, dtype, device)
        self._caches: dict[tuple, object] = {}
        self._compiled = None
        # every (bucket, length) pair is one compiled graph of the same function
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)

    def _step(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor, cache) -> Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, **{self.cache_name: cache}, **self.keep_last)  # fmt: skip
        return out.logits[:, -1].float()

    def __call__(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor, cache) -> Tensor:
        """logits of the fed tokens, [bucket, V] float32; input_ids / position_ids [bucket, 1]
        int64, attention_mask [bucket, length] int64, cache from :meth:`cache`."""
        if self._compiled is None:
            mode = "reduce-overhead" if input_ids.device.type == "cuda" else None
            self._compiled = torch.compile(self._step, dynamic=False, mode=mode)
        key = (input_ids.shape[0], attention_mask.shape[1], str(cache.layers[0].keys.dtype), str(input_ids.device))
        if key in self._shapes:
            return self._compiled(input_ids, position_ids, attention_mask, cache)
        start = time.perf_counter()
        out = self._compiled(input_ids, position_ids, attention_mask, cache)
        seconds = time.perf_counter() - start
        self._shapes.add(key)
        self.compiles += 1
        self.compile_seconds += seconds
        log.info("rollout.compile: decode step compiled for %d rows × %d cache columns (%s, %s) in %.1f s", *key, seconds)
        if self.compiles > torch._dynamo.config.recompile_limit:
            log.warning("rollout.compile: %d decode-step shapes exceed torch._dynamo.config.recompile_limit=%d; "
                        "further shapes run eagerly (raise the limit, or length_multiple)", self.compiles,
                        torch._dynamo.config.recompile_limit)  # fmt: skip
        return out

    def length_bucket(self, columns: int) -> int:
        return -(-columns // self.length_multiple) * self.length_multiple

    @staticmethod
    def batch_bucket(rows: int, chunk_rows: int) -> int:
        """chunk_rows itself while rows > chunk_rows / 2, else the smallest power of two ≥ rows."""
        if 2 * rows > chunk_rows:
            return chunk_rows
        return 1 << max(rows - 1, 0).bit_length()

    def cache(self, bucket: int, length: int, like: Tensor | None):
        """The StaticCache for (bucket, length), reset to empty; allocated on first use.
        like: a KV tensor [rows, kv heads, columns, head_dim] giving heads, head_dim, dtype and
        device (None: taken from the model's config and parameters, the dtype from autocast when on)."""
        from transformers import StaticCache

        config = self.model.config.get_text_config(decoder=True)
        param = next(self.model.parameters())
        if like is not None:
            heads, head_dim, dtype, device = like.shape[1], like.shape[3], like.dtype, like.device
        else:
            heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            dtype, device = param.dtype, param.device
            if torch.is_autocast_enabled(device.type):  # rollout.dtype under autocast: K/V come in its dtype
                dtype = torch.get_autocast_dtype(device.type)
        # dtype and device in the key: a model cast or moved after compiling gets caches of its own
        key = (bucket, length, heads, head_dim, dtype, str(device))
        cache = self._caches.get(key)
        if cache is None:
            cache = StaticCache(config=config, max_cache_len=length)
            cache.early_initialization(bucket, heads, head_dim, dtype, device)
            self._caches[key] = cache
        else:
            cache.reset()
        return cache


def fill_static(cache, source_layers: list[tuple[Tensor, Tensor]], rows: Tensor, columns: int) -> None:
    """Copy ``columns`` cached columns of rows ``rows`` ([bucket] int64 indices into the source)
    into ``cache`` (a StaticCache from :meth:`CompiledDecodeStep.cache`), and set its length."""
    for layer, (keys, values) in zip(cache.layers, source_layers, strict=True):
        if columns:
            layer.keys[:, :, :columns].copy_(keys.index_select(0, rows)[:, :, :columns])
            layer.values[:, :, :columns].copy_(values.index_select(0, rows)[:, :, :columns])
        layer.cumulative_length.fill_(columns)


def kv_layers(cache) -> list[tuple[Tensor, Tensor]]:
    """(keys, values) per layer of a transformers Cache (dynamic or static)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def decode_static(
    step: CompiledDecodeStep, ids: Tensor, mask: Tensor, sampling, uniforms: Tensor | None, pad_token_id: int, *,
    prefix_cache: dict[str, object] | None = None, on_finished=None, interrupt=None, pause=None,
):
    """:func:`workers.rollout.decode.decode` (which checks the left padding and calls this) with
    each decode step run by ``step`` on a static cache (same arguments, same
    :class:`~workers.rollout.decode_step.DecodeResult`). The prompt's
    first L-1 columns are prefilled eagerly (or taken from ``prefix_cache``) and copied into the
    static cache. Same sampling (:func:`~workers.rollout.decode_step.pick_tokens`) and positions, so
    greedy tokens equal the eager loop's and log-probs agree to float rounding."""
    n_rows, width = ids.shape
    new = sampling.max_new_tokens
    stops = torch.as_tensor(list(sampling.stop_token_ids), dtype=torch.int64, device=ids.device)
    positions = position_ids_from_mask(mask)
    with torch.no_grad():
        prefix = prefill(step.model, ids, mask, positions, prefix_cache)
        source = None if prefix is None else kv_layers(prefix)
        length = step.length_bucket(width - 1 + new)
        bucket = step.batch_bucket(n_rows, n_rows)
        slots = torch.cat([torch.arange(n_rows), torch.zeros(bucket - n_rows, dtype=torch.int64)]).to(ids.device)
        cache = step.cache(bucket, length, None if source is None else source[0][0])
        if source is not None:
            fill_static(cache, source, slots, width - 1)
        attn = torch.zeros((bucket, length), dtype=torch.int64, device=ids.device)
        attn[:, :width] = mask[slots].long()
        feed, pos = ids[slots, -1:].clone(), positions[slots, -1:].clone()
        alive = torch.arange(n_rows, device=ids.device)  # original row of each live row
        live = torch.arange(n_rows, device=ids.device)  # its slot in the bucket
        tokens = torch.full((n_rows, new), pad_token_id, dtype=torch.int64, device=ids.device)
        log_probs = torch.zeros((n_rows, new), dtype=torch.float32, device=ids.device)
        row_steps, steps = 0, 0
        for t in range(new):
            logits = step(feed, pos, attn, cache)
            row_steps += bucket
            steps = t + 1
            token, done = take_step(logits[live], sampling, uniforms, alive, t, stops, tokens, log_probs)
            if t + 1 == new or bool(done.all()):
                break
            if interrupt is not None and interrupt(t + 1) and not (pause is not None and pause(int((~done).sum()))):
                break  # (a pause that resumed loaded new weights in place: the live rows go on, on their KV)
            feed[live, 0] = token
            pos += 1
            attn[:, width + t] = 1
            if bool(done.any()):
                stay = (~done).nonzero().squeeze(1)
                alive, live = alive[stay], live[stay]
                if on_finished is not None:
                    on_finished(n_rows - len(alive))
                smaller = step.batch_bucket(len(alive), n_rows)
                if smaller < bucket:  # move the live rows into the smaller bucket's cache
                    slots = torch.cat([live, live[:1].expand(smaller - len(live))])
                    moved = step.cache(smaller, length, cache.layers[0].keys)
                    fill_static(moved, kv_layers(cache), slots, width + t)
                    cache, bucket = moved, smaller
                    attn, feed, pos = attn[slots], feed[slots], pos[slots]
                    live = torch.arange(len(alive), device=ids.device)
    tokens, log_probs = tokens[:, :steps], log_probs[:, :steps]
    return DecodeResult(tokens, log_probs, row_steps, useful_row_steps(tokens, stops))


__all__ = ["CompiledDecodeStep", "decode_static", "fill_static", "kv_layers"]
