"""A fused CPU decode step for Llama-family causal LMs (``rollout.fused_decode``).

At batch 32 a decode step of SmolLM2-135M spent about a third of its time outside the matrix
products: transformers' decoder layer runs ~40 small ops per layer per step (RMSNorm as five
elementwise ops, three q/k/v and two gate/up products, rotary as a ``cat`` of halves, a
``torch.cat`` KV-cache append per layer, a 4-D mask rebuilt each step, residual adds), each a
dispatch of a few microseconds on rows of 576 floats (docs/benchmarks.md, ``rollout``). Here the
same step runs as a short loop over the layers on weights prepared once per generate call:

* q, k and v projections as one product on a concatenated weight, gate and up as another
  (vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear``), each on a weight reordered
  once into oneDNN's blocked layout (as :mod:`workers.rollout.packed_weights`);
* the o and down projections add the residual inside the product (oneDNN's binary ``add``
  post-op, ``torch.ops.mkldnn._linear_pointwise.binary``); SiLU and the gate-up product are two
  ops on the fused product's halves;
* RMSNorm is ``torch.nn.functional.rms_norm`` (one op), rotary is applied to q and k together;
* the KV cache is one buffer per layer ([rows, kv_heads, columns, head_dim], allocated for the
  prompt plus ``GROW_COLUMNS`` and doubled when full) and each step writes its column in place
  (no ``torch.cat``); finished rows are compacted to the front;
* grouped-query attention runs without repeating keys: the query heads of one KV head are the
  "query positions" of that head's attention. In a decode step it is two batched products and a
  softmax (scores ``q @ k.T`` scaled, plus an additive mask built once per step, then ``@ v``):
  at 32 rows × 3 KV heads × 3 query heads over ~60–300 columns this took about half the time
  of ``scaled_dot_product_attention``, whose CPU flash kernel is built for long queries
  (0.14 vs 0.26 ms per layer at 60 columns, 0.53 vs 0.70 at 300; bench/fused_decode.py); the
  prefill, with long queries, keeps ``scaled_dot_product_attention``.

The arithmetic is transformers' ``LlamaDecoderLayer`` (``modeling_llama.py``): pre-norm
attention and MLP with residuals, rotary from the model's own ``rotary_emb`` (so every RoPE
scaling type it supports), scale ``head_dim ** -0.5``. Results differ from the unfused forward by
float rounding only (another summation order in the products and the norm); the equality tests
in tests/unit/test_rollout_fused_decode.py bound greedy tokens (equal) and log-probs.

bfloat16 (``rollout.dtype``, issue 41): ``FusedDecoder(model, rows, dtype=torch.bfloat16)`` prepares
its weight copies in bfloat16 from the module's (float32 or bfloat16) weights at the start of each
generate call, keeps the residual stream and the KV cache in bfloat16, takes the attention softmax in
float32 (cast back), and returns float32 logits (so the log-softmax and rollout_log_probs are float32).
float32 runs exactly as before.

Supported: ``LlamaForCausalLM``, ``MistralForCausalLM`` (no sliding window) and
``Qwen2ForCausalLM`` (q/k/v bias; no sliding window) with float32 (or bfloat16) CPU weights, SiLU MLPs, plain
``nn.Linear`` projections (no LoRA or quantized layers), no forward hooks. Anything else
returns None from :func:`fused_decoder` and decodes through the model's own forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridflow.algorithms.sequences import position_ids_from_mask
from workers.rollout.packed_weights import available as packed_available
from workers.rollout.packed_weights import packable
from workers.shared_prefix import forward_kwargs, unwrapped

_SUPPORTED = {"llama", "mistral", "qwen2"}
GROW_COLUMNS = 128  # KV-cache columns allocated beyond the prompt at first; doubled when full
FUSED_DTYPES = (torch.float32, torch.bfloat16)  # module weights it reads, and dtypes it decodes in


@dataclass
class _Layer:
    norm_in: Tensor  # [H]
    qkv: Tensor  # packed [(nh + 2 kvh) * D, H]
    qkv_bias: Tensor | None
    o: Tensor  # packed [H, nh * D]
    o_bias: Tensor | None
    norm_post: Tensor
    gate_up: Tensor  # packed [2 I, H]
    down: Tensor  # packed [H, I]


def _plain_tensor(w: object) -> bool:
    """A plain (not DTensor / quantized / meta) non-empty float32 or bfloat16 CPU parameter."""
    return (isinstance(w, Tensor) and type(w.data) is Tensor and w.numel() > 0 and w.dtype in FUSED_DTYPES
            and w.device.type == "cpu")  # fmt: skip


def _plain(module: object, cls: type) -> bool:
    """Exactly ``cls`` (no subclass, peft or quantized wrapper), no forward of its own on the
    instance, no hooks, a plain float32 CPU weight."""
    return (type(module) is cls and "forward" not in module.__dict__ and not module._forward_hooks
            and not module._forward_pre_hooks and _plain_tensor(getattr(module, "weight", None)))  # fmt: skip


def _plain_linear(module: object, bias: bool | None = False) -> bool:
    """An ``nn.Linear`` that :mod:`workers.rollout.packed_weights` would pack, with a plain float32
    CPU weight and bias; bias: required (True), absent (False) or either (None)."""
    if not packable(module, FUSED_DTYPES):
        return False
    if module.bias is not None and not _plain_tensor(module.bias):
        return False
    return bias is None or (module.bias is not None) == bias


def _classes(kind: str) -> tuple[type, ...]:
    """transformers' (CausalLM, DecoderLayer, RMSNorm, RotaryEmbedding) classes of ``kind``."""
    import importlib

    mod = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    name = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}[kind]
    return tuple(getattr(mod, f"{name}{part}") for part in ("ForCausalLM", "DecoderLayer", "RMSNorm", "RotaryEmbedding"))


def why_not_fused(model: nn.Module) -> str | None:
    """None when :func:`fused_decoder` can run ``model``, else the reason it cannot (one line).

    Accepted: exactly transformers' ``LlamaForCausalLM`` / ``MistralForCausalLM`` /
    ``Qwen2ForCausalLM`` (not a subclass or remote code declaring that model type), made of
    that family's own decoder-layer, RMSNorm and rotary classes, plain ``nn.Embedding`` and
    ``nn.Linear`` modules with float32 CPU weights, full attention, a SiLU MLP without bias, and
    no forward hooks anywhere (a hook would not run)."""
    if not packed_available():
        return "this torch build has no oneDNN linear kernels"
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in _SUPPORTED:
        return f"model_type {kind!r} is not one of {sorted(_SUPPORTED)}"
    causal_lm, layer_cls, norm_cls, rotary_cls = _classes(kind)
    if type(model) is not causal_lm:
        return f"{type(model).__name__} is not transformers' {causal_lm.__name__} (a subclass or remote code)"
    layer_types = set(getattr(cfg, "layer_types", None) or ())
    if (getattr(cfg, "use_sliding_window", False) or (kind == "mistral" and getattr(cfg, "sliding_window", None))
            or layer_types - {"full_attention"}):  # fmt: skip
        return "sliding-window attention"
    if getattr(cfg, "hidden_act", None) != "silu" or getattr(cfg, "mlp_bias", False):
        return f"MLP with hidden_act={getattr(cfg, 'hidden_act', None)!r}, mlp_bias={getattr(cfg, 'mlp_bias', False)}"
    if getattr(cfg, "pretraining_tp", 1) not in (1, None):
        return "pretraining_tp > 1"
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    if len(dtypes) != 1 or dtypes[0] not in ("float32", "bfloat16"):
        return f"weights in {', '.join(dtypes)}, not float32 (or all bfloat16)"
    hooked = [name or type(model).__name__ for name, m in model.named_modules()
              if m._forward_hooks or m._forward_pre_hooks]  # fmt: skip
    if hooked:
        return f"forward hooks on {hooked[0]} (they would not run)"
    inner = model.model
    if not _plain(inner.embed_tokens, nn.Embedding) or getattr(inner.embed_tokens, "max_norm", None) is not None:
        return "model.embed_tokens is not a plain float32 CPU nn.Embedding (LoRA, trainable tokens, quantized)"
    if not _plain_linear(model.get_output_embeddings(), None):
        return "the LM head is not a plain float32 CPU nn.Linear"
    if type(inner.norm) is not norm_cls or type(inner.rotary_emb) is not rotary_cls:
        return f"model.norm / model.rotary_emb are not {norm_cls.__name__} / {rotary_cls.__name__}"
    qkv_bias = bool(getattr(cfg, "attention_bias", False)) or kind == "qwen2"
    for i, layer in enumerate(_run_layers(model)):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if type(layer) is not layer_cls or attn is None or mlp is None:
            return f"layer {i} is not a plain {layer_cls.__name__}"
        if type(layer.input_layernorm) is not norm_cls or type(layer.post_attention_layernorm) is not norm_cls:
            return f"layer {i}: norms are not {norm_cls.__name__}"
        if any(not _plain_linear(getattr(attn, n, None), qkv_bias) for n in ("q_proj", "k_proj", "v_proj")):
            return f"layer {i}: q/k/v projections are not plain float32 CPU nn.Linear (LoRA, quantized, or another device)"
        if not _plain_linear(getattr(attn, "o_proj", None), None):
            return f"layer {i}: o_proj is not a plain float32 CPU nn.Linear"
        if any(not _plain_linear(getattr(mlp, n, None)) for n in ("gate_proj", "up_proj", "down_proj")):
            return f"layer {i}: MLP projections are not plain float32 CPU nn.Linear without bias"
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            return f"layer {i}: q/k norms (Qwen3-style) are not supported"
    return None


def why_not_fused_engine(model: nn.Module) -> str | None:
    """:func:`why_not_fused` for a rollout engine's model, which may be wrapped (peft, DDP) or
    compiled: None when its single-turn calls can decode through :class:`FusedDecoder`, else why
    not (one line). Also falls back for a model off the CPU, a ``torch.compile`` wrapper, a forward
    without a KV-cache argument, CPU autocast, and peft prompt-learning adapters (their virtual
    tokens live outside the base model)."""
    if next(model.parameters()).device.type != "cpu":
        return "the model is not on a CPU"
    if hasattr(model, "_orig_mod"):
        return "the model is wrapped by torch.compile (transformers' generate decodes it)"
    if forward_kwargs(model)[0] is None:
        return "the model's forward takes no KV cache argument (transformers' generate decodes it)"
    if torch.is_autocast_enabled("cpu"):
        return "CPU autocast is on"
    peft_configs = getattr(model, "peft_config", None) or {}
    if any(getattr(c, "is_prompt_learning", False) for c in peft_configs.values()):
        return "a peft prompt-learning adapter (its virtual tokens live outside the base model)"
    return why_not_fused(unwrapped(model))


def _run_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers transformers' forward runs: the first ``config.num_hidden_layers``."""
    return list(model.model.layers[: model.config.num_hidden_layers])


class FusedDecoder:
    """Decode steps of one Llama-family model on weights prepared once (see the module docstring).

    Build with :func:`fused_decoder` inside ``torch.no_grad``; the prepared weights are copies,
    so build a new one after each weight update (the hf engine builds one per generate call), or
    call :meth:`prepare_weights` after a load in place between two steps.
    dtype: what it decodes in (float32 or bfloat16; None = the model's weights' dtype): weights,
    residual stream and KV cache; logits are returned in float32 either way.
    """

    def __init__(self, model: nn.Module, rows_hint: int, dtype: torch.dtype | None = None) -> None:
        cfg = model.config
        inner = model.model
        self.model = model
        self.dtype = dtype = inner.embed_tokens.weight.dtype if dtype is None else dtype
        if dtype not in FUSED_DTYPES:
            raise ValueError(f"fused decode: dtype {dtype} is not float32 or bfloat16")
        self.rotary = inner.rotary_emb
        self.eps = float(cfg.rms_norm_eps)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads)
        self.hidden = int(cfg.hidden_size)
        self.hint = max(1, int(rows_hint))
        layers = _run_layers(model)
        self.eps_in = [float(layer.input_layernorm.variance_epsilon) for layer in layers]
        self.eps_post = [float(layer.post_attention_layernorm.variance_epsilon) for layer in layers]
        self.eps_final = float(inner.norm.variance_epsilon)
        self.prepare_weights()
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.mask: Tensor | None = None
        self.length = 0  # columns of the cache filled
        self.total = 0  # columns the call may fill (prompt + max new tokens)

    def prepare_weights(self) -> None:
        """(Re)build every weight form the steps read from the module's weights as they are now:
        the packed q/k/v, o, gate/up, down and LM-head products, the norms, biases and embedding in
        ``dtype``. The KV cache is left as it is: after weights were loaded in place between two
        steps (``rollout.partial: pause``) the same rows go on, on the keys and values they have."""
        dtype, hint, inner = self.dtype, self.hint, self.model.model

        def pack(*weights: Tensor) -> Tensor:
            w = weights[0] if len(weights) == 1 else torch.cat(weights, 0)
            return torch.ops.mkldnn._reorder_linear_weight(w.detach().to(dtype).contiguous(), hint)

        def vec(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.detach().to(dtype).contiguous()

        self.embed = inner.embed_tokens.weight.detach().to(dtype)
        self.norm_final = inner.norm.weight.detach().to(dtype)
        self.layers: list[_Layer] = []
        for layer in _run_layers(self.model):
            a, m = layer.self_attn, layer.mlp
            bias = None
            if a.q_proj.bias is not None:
                bias = vec(torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]))
            self.layers.append(_Layer(
                norm_in=layer.input_layernorm.weight.detach().to(dtype),
                qkv=pack(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight), qkv_bias=bias,
                o=pack(a.o_proj.weight), o_bias=vec(a.o_proj.bias),
                norm_post=layer.post_attention_layernorm.weight.detach().to(dtype),
                gate_up=pack(m.gate_proj.weight, m.up_proj.weight), down=pack(m.down_proj.weight)))
        head = self.model.get_output_embeddings()
        self.lm_head = pack(head.weight)
        self.lm_bias = vec(head.bias)

    def prefill(self, ids: Tensor, mask: Tensor, rows: Tensor | None, max_new_tokens: int) -> None:
        """Compute the KV cache of the first L-1 columns of U distinct prompts once and give each
        of N rows a copy of its prompt's; make room for the call's ``max_new_tokens`` decode steps
        (the first feeds the prompt's last token, the last generated token is never fed).

        ids / mask: [U, L] int64 / bool, left padded, every row ending in a real token; rows: [N]
        int64, the prompt of each decode row (None: N = U, row r is prompt r). Positions come from
        the mask, as in transformers' ``generate``. A padded query position attends to itself
        too, so no attention row is empty (its outputs are never attended to by a real token).
        The KV buffers start with room for ``GROW_COLUMNS`` new columns and double (holding only
        the live rows) when full, so a long ``max_new_tokens`` costs memory only as rows reach it."""
        u, cols = ids.shape
        if not bool(mask[:, -1].all()):
            raise ValueError("fused decode: every prompt row must end in a real token (left padding)")
        rows = torch.arange(u, device=ids.device) if rows is None else rows
        self.total = cols + max_new_tokens - 1
        self._allocate(len(rows), min(self.total, cols + GROW_COLUMNS), ids.device)
        self.mask[:, :cols] = mask.index_select(0, rows)
        self.length = cols - 1
        s = cols - 1
        if s == 0:
            return
        d, nh, kvh = self.head_dim, self.heads, self.kv_heads
        pre_mask = mask[:, :s]
        positions = position_ids_from_mask(pre_mask)
        causal = torch.ones((s, s), dtype=torch.bool, device=ids.device).tril_()
        attend = (causal & pre_mask[:, None, :]) | torch.eye(s, dtype=torch.bool, device=ids.device)
        attend = attend.unsqueeze(1)  # [U, 1, s, s]
        h = F.embedding(ids[:, :s], self.embed).reshape(u * s, self.hidden)
        cos, sin = self.rotary(h, positions)  # [U, s, D]
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        for i, layer in enumerate(self.layers):
            x = F.rms_norm(h, (self.hidden,), layer.norm_in, self.eps_in[i])
            qkv = _linear(x, layer.qkv, layer.qkv_bias).view(u, s, nh + 2 * kvh, d)
            qk = _rotate(qkv[:, :, : nh + kvh], cos, sin).transpose(1, 2)  # [U, nh + kvh, s, D]
            k, v = qk[:, nh:], qkv[:, :, nh + kvh :].transpose(1, 2)
            self.keys[i][:, :, :s] = k.index_select(0, rows)
            self.values[i][:, :, :s] = v.index_select(0, rows)
            out = F.scaled_dot_product_attention(qk[:, :nh], k, v, attn_mask=attend, scale=d**-0.5,
                                                 enable_gqa=nh != kvh)  # fmt: skip
            h = _binary(out.transpose(1, 2).reshape(u * s, nh * d), h, layer.o, "add", layer.o_bias)
            h = self._mlp(h, layer, i)

    def _allocate(self, n: int, columns: int, device: torch.device) -> None:
        """Fresh KV buffers [n, kv_heads, columns, head_dim] per layer and a mask [n, columns]
        (True beyond the prompt: every live row fills each new column)."""
        shape = (n, self.kv_heads, columns, self.head_dim)
        self.keys = [torch.empty(shape, dtype=self.dtype, device=device) for _ in self.layers]
        self.values = [torch.empty(shape, dtype=self.dtype, device=device) for _ in self.layers]
        self.mask = torch.ones((n, columns), dtype=torch.bool, device=device)

    def _grow(self, n: int) -> None:
        """Room for more columns: twice the current capacity (at most the call's total), holding
        only the n live rows; the filled columns are copied over."""
        t, keys, values, mask = self.length, self.keys, self.values, self.mask
        self._allocate(n, min(self.total, 2 * keys[0].shape[2]), mask.device)
        for old, new in zip((*keys, *values), (*self.keys, *self.values), strict=True):
            new[:, :, :t] = old[:n, :, :t]
        self.mask[:, :t] = mask[:n, :t]

    def _mlp(self, h: Tensor, layer: _Layer, i: int) -> Tensor:
        """h + down(silu(gate(x)) * up(x)) with x = RMSNorm(h); h [rows, H]."""
        x = F.rms_norm(h, (self.hidden,), layer.norm_post, self.eps_post[i])
        gu = _linear(x, layer.gate_up)
        inter = gu.shape[1] // 2
        return _binary(F.silu(gu[:, :inter]).mul_(gu[:, inter:]), h, layer.down, "add")

    def keep_rows(self, stay: Tensor) -> None:
        """Keep only cache rows ``stay`` ([k] int64, increasing), moved to the front, in place."""
        k, t = len(stay), self.length
        for buf in (*self.keys, *self.values):
            buf[:k, :, :t] = buf[stay, :, :t]
        self.mask[:k] = self.mask[stay]

    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """One decode step for the first n cache rows: tokens [n] int64 and their positions [n]
        int64 → logits [n, vocab] float32 (also when decoding in bfloat16). Writes the tokens' keys/values at column ``length``."""
        n, t, d = tokens.shape[0], self.length, self.head_dim
        nh, kvh = self.heads, self.kv_heads
        if t >= self.keys[0].shape[2]:
            if t >= self.total:
                raise ValueError(f"fused decode: a step past the {self.total} columns prefill made room for")
            self._grow(n)
        h = F.embedding(tokens, self.embed)  # [n, H]
        cos, sin = self.rotary(h, positions.unsqueeze(1))  # [n, 1, D]
        # additive mask [n, 1, 1, t+1]: -inf at prompt padding; every row attends to its own column t
        mask = torch.zeros((n, 1, 1, t + 1), dtype=h.dtype, device=h.device)
        mask.masked_fill_(~self.mask[:n, None, None, : t + 1], float("-inf"))
        scale = d**-0.5
        for i, layer in enumerate(self.layers):
            x = F.rms_norm(h, (self.hidden,), layer.norm_in, self.eps_in[i])
            qkv = _linear(x, layer.qkv, layer.qkv_bias).view(n, nh + 2 * kvh, d)
            qk = _rotate(qkv[:, : nh + kvh], cos, sin)  # [n, nh + kvh, D]
            keys, values = self.keys[i], self.values[i]
            keys[:n, :, t] = qk[:, nh:]
            values[:n, :, t] = qkv[:, nh + kvh :]
            # the query heads sharing a KV head are that head's query "positions" (no repeat_kv)
            q = qk[:, :nh].reshape(n, kvh, nh // kvh, d)
            scores = torch.matmul(q, keys[:n, :, : t + 1].transpose(-1, -2)).mul_(scale).add_(mask)
            out = torch.matmul(self._softmax(scores), values[:n, :, : t + 1])  # [n, kvh, nh // kvh, D]
            h = _binary(out.reshape(n, nh * d), h, layer.o, "add", layer.o_bias)
            h = self._mlp(h, layer, i)
        self.length = t + 1
        h = F.rms_norm(h, (self.hidden,), self.norm_final, self.eps_final)
        return _linear(h, self.lm_head, self.lm_bias).float()

    def _softmax(self, scores: Tensor) -> Tensor:
        """Softmax over the last dim; in float32 (cast back) when decoding in bfloat16."""
        if self.dtype == torch.float32:
            return torch.softmax(scores, -1)
        return torch.softmax(scores, -1, dtype=torch.float32).to(self.dtype)


def _linear(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _binary(x: Tensor, other: Tensor, packed: Tensor, op: str, bias: Tensor | None = None) -> Tensor:
    """(x @ W.T + bias) (op) other in one oneDNN call (a post-op), W packed."""
    return torch.ops.mkldnn._linear_pointwise.binary(x, other, packed, bias, op)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of x [..., heads, D] with cos / sin broadcast over heads: transformers'
    ``apply_rotary_pos_emb`` (x * cos + rotate_half(x) * sin), same ops in the same order."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def fused_decoder(model: nn.Module, rows_hint: int, dtype: torch.dtype | None = None) -> FusedDecoder | None:
    """A :class:`FusedDecoder` for ``model`` (decoding in ``dtype``), or None when
    :func:`why_not_fused` names a reason."""
    if why_not_fused(model) is not None:
        return None
    with torch.no_grad():
        return FusedDecoder(model, rows_hint, dtype)


__all__ = ["FusedDecoder", "fused_decoder", "why_not_fused", "why_not_fused_engine"]
