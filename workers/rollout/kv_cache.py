"""Multi-turn KV caches of the hf engine: one trajectory's cache kept between turns
(:class:`KVCache`), and the ready cache ``generate`` starts the next turn from (:func:`ready_cache`).
Used by :meth:`workers.rollout.hf.HFRolloutEngine.generate_continuing`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from workers.shared_prefix import forward_kwargs


@dataclass
class KVCache:
    """One trajectory's KV cache between turns: per layer (keys, values) [kv_heads, valid, head_dim]
    of its first ``valid`` tokens (no padding)."""

    layers: list[tuple[Tensor, Tensor]]
    valid: int

    def truncated(self, n: int) -> KVCache:
        """The cache of the first ``n`` tokens (n ≥ valid returns self)."""
        if n >= self.valid:
            return self
        return KVCache([(k[:, :n], v[:, :n]) for k, v in self.layers], max(n, 0))


def ready_cache(model: nn.Module, caches: list[KVCache | None], pads: list[int], cut: int) -> dict[str, Any]:
    """A DynamicCache of the first ``cut`` columns of the left-padded rows (zeros on padding,
    masked out anyway), as the ``generate`` kwarg the model takes; {} when no row has a cache."""
    from transformers.cache_utils import DynamicCache

    name, _ = forward_kwargs(model)
    ref = next((c for c in caches if c is not None), None)
    if name is None or ref is None:
        return {}
    cache = DynamicCache()
    for layer, (k0, v0) in enumerate(ref.layers):
        ks, vs = [], []
        for c, p in zip(caches, pads, strict=True):
            lead = min(p, cut)
            zk = k0.new_zeros((k0.shape[0], lead, k0.shape[2]))
            zv = v0.new_zeros((v0.shape[0], lead, v0.shape[2]))
            take = cut - lead
            ks.append(torch.cat([zk, c.layers[layer][0][:, :take]], 1) if take else zk)
            vs.append(torch.cat([zv, c.layers[layer][1][:, :take]], 1) if take else zv)
        cache.update(torch.stack(ks), torch.stack(vs), layer)
    return {name: cache}


__all__ = ["KVCache", "ready_cache"]
