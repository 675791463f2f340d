"""The batch contract: the one type that crosses worker, task and storage boundaries.

A :class:`Batch` holds tensors that share the leading dimension ``batch``
(trajectories, not prompts) in a :class:`tensordict.TensorDict`, plus per-row
non-tensor fields (``uid``, ``data_source``, ``ground_truth``, ``extra_info``,
``finish_reason``, ...) as Python lists of JSON-serialisable values, plus ``meta``
(batch-level JSON info such as ``weights_version``).

Keys, shapes and dtypes (docs/architecture.md names where each batch is saved):

============================================  ================================  =============
key                                           shape                             dtype
============================================  ================================  =============
prompt_ids / prompt_mask                      [batch, prompt_len] left padded    int64 / bool
response_ids / response_mask                  [batch, response_len] right pad    int64 / bool
position_ids                                  [batch, prompt_len+response_len]  int64
observation_mask (multi-turn only)            [batch, response_len] right pad    bool
============================================  ================================  =============

``observation_mask`` marks the response tokens a multi-turn rollout inserted between the model's
turns (tool results, environment messages, end-of-turn tokens): real tokens the model attends to
but is not trained on. Attention covers prompt_mask ‖ (response_mask | observation_mask).

============================================  ================================  =============
key                                           shape                             dtype
============================================  ================================  =============
rollout_log_probs, old_log_probs, ref_...     [batch, response_len]              float32 nats
values, token_level_scores/rewards,
advantages, returns                           [batch, response_len]              float32
============================================  ================================  =============

:class:`BatchRef` is the small serialisable reference Prefect tasks pass around.
Storage: ``<uri>.safetensors`` (tensors, bit exact) + ``<uri>.json`` (non-tensors,
meta) through fsspec, so any fsspec URI works (local path, ``memory://``, ``s3://``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import fsspec
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from tensordict import TensorDict

KEY_DTYPES: dict[str, torch.dtype] = {
    "prompt_ids": torch.int64,
    "prompt_mask": torch.bool,
    "response_ids": torch.int64,
    "response_mask": torch.bool,
    "position_ids": torch.int64,
    "observation_mask": torch.bool,
    "rollout_log_probs": torch.float32,
    "old_log_probs": torch.float32,
    "ref_log_probs": torch.float32,
    "values": torch.float32,
    "token_level_scores": torch.float32,
    "token_level_rewards": torch.float32,
    "advantages": torch.float32,
    "returns": torch.float32,
    "rollout_token_versions": torch.int64,
}
RESPONSE_KEYS = (
    "response_mask",
    "observation_mask",
    "rollout_log_probs",
    "old_log_probs",
    "ref_log_probs",
    "values",
    "token_level_scores",
    "token_level_rewards",
    "advantages",
    "returns",
    "rollout_token_versions",
)

_PROMPT_KEYS = ("prompt_ids", "prompt_mask")


class BatchError(ValueError):
    """A batch violates the contract (shape, dtype, length or missing key)."""


@dataclass(frozen=True)
class BatchRef:
    """Serialisable reference to a saved batch: what Prefect tasks return and take.

    ``uri`` is the storage prefix (``.safetensors`` / ``.json`` are appended);
    ``checksum`` is the sha256 of both files' bytes, so two refs to the same content
    compare equal and make deterministic cache keys.
    """

    run_id: str
    iteration: int
    node: str
    uri: str
    rows: int
    keys: tuple[str, ...]
    checksum: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "iteration": self.iteration,
            "node": self.node,
            "uri": self.uri,
            "rows": self.rows,
            "keys": list(self.keys),
            "checksum": self.checksum,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BatchRef:
        return cls(**{**d, "keys": tuple(d["keys"])})

    def load(self, *, verify: bool = True) -> Batch:
        return Batch.load(self.uri, expected_checksum=self.checksum if verify else None)


@dataclass
class Batch:
    """Tensors with a shared leading dim + per-row non-tensor lists + batch-level meta."""

    tensors: TensorDict
    non_tensors: dict[str, list[Any]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    # ---- construction / validation -----------------------------------------------------------
    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor],
        non_tensors: dict[str, Sequence[Any]] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> Batch:
        """Build and validate. Raises BatchError on mismatched lengths or wrong dtypes of known keys."""
        lengths = {k: v.shape[0] for k, v in tensors.items()}
        lengths.update({k: len(v) for k, v in (non_tensors or {}).items()})
        if len(set(lengths.values())) > 1:
            raise BatchError(f"batch fields have different lengths: {lengths}")
        n = next(iter(lengths.values()), 0)
        for k, v in tensors.items():
            want = KEY_DTYPES.get(k)
            if want is not None and v.dtype != want:
                raise BatchError(f"batch key {k!r} has dtype {v.dtype}, the contract says {want}")
        td = TensorDict(dict(tensors), batch_size=[n])
        return cls(td, {k: list(v) for k, v in (non_tensors or {}).items()}, dict(meta or {}))

    def __len__(self) -> int:
        return int(self.tensors.batch_size[0]) if self.tensors.batch_size else 0

    def __getitem__(self, key: str) -> Any:
        if key in self.tensors.keys():
            return self.tensors[key]
        if key in self.non_tensors:
            return self.non_tensors[key]
        raise KeyError(f"batch has no key {key!r}; keys: {sorted(self.keys())}")

    def __contains__(self, key: str) -> bool:
        return key in self.tensors.keys() or key in self.non_tensors

    def keys(self) -> list[str]:
        return sorted([*self.tensors.keys(), *self.non_tensors.keys()])

    def set(self, key: str, value: torch.Tensor | Sequence[Any]) -> None:
        """Add or replace one field (tensor or per-row list), checking length and dtype."""
        if isinstance(value, torch.Tensor):
            if value.shape[0] != len(self):
                raise BatchError(f"{key!r} has {value.shape[0]} rows, batch has {len(self)}")
            want = KEY_DTYPES.get(key)
            if want is not None and value.dtype != want:
                raise BatchError(f"batch key {key!r} has dtype {value.dtype}, the contract says {want}")
            self.tensors.set(key, value)
        else:
            if len(value) != len(self):
                raise BatchError(f"{key!r} has {len(value)} rows, batch has {len(self)}")
            self.non_tensors[key] = list(value)

    # ---- row operations ----------------------------------------------------------------------
    def shallow_copy(self) -> Batch:
        """A new Batch sharing this one's tensors and lists, whose fields can be set or replaced
        without touching this batch (the containers are copied, the values are not)."""
        return Batch(self.tensors.clone(recurse=False), dict(self.non_tensors), dict(self.meta))

    def select(self, keys: Iterable[str]) -> Batch:
        """A batch with only ``keys`` (tensor or non-tensor); meta is kept."""
        keys = list(keys)
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"batch has no keys {missing}; keys: {self.keys()}")
        td = self.tensors.select(*[k for k in keys if k in self.tensors.keys()])
        nt = {k: list(v) for k, v in self.non_tensors.items() if k in keys}
        return Batch(td, nt, dict(self.meta))

    def index(self, idx: Sequence[int] | torch.Tensor) -> Batch:
        """Rows ``idx`` in that order."""
        idx_t = torch.as_tensor(idx, dtype=torch.long)
        idx_l = idx_t.tolist()
        return Batch(
            self.tensors[idx_t],
            {k: [v[i] for i in idx_l] for k, v in self.non_tensors.items()},
            dict(self.meta),
        )

    def union(self, other: Batch) -> Batch:
        """Fields of both (same rows). A key in both must hold equal values, else BatchError."""
        if len(self) != len(other):
            raise BatchError(f"union of batches with {len(self)} and {len(other)} rows")
        td = self.tensors.clone(recurse=False)
        for k in other.tensors.keys():
            if k in td.keys() and not torch.equal(td[k], other.tensors[k]):
                raise BatchError(f"union: key {k!r} differs between batches")
            td.set(k, other.tensors[k])
        nt = dict(self.non_tensors)
        for k, v in other.non_tensors.items():
            if k in nt and nt[k] != v:
                raise BatchError(f"union: key {k!r} differs between batches")
            nt[k] = list(v)
        return Batch(td, nt, {**self.meta, **other.meta})

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Stack rows. Tensors along dim 0 with right padding of response-like keys and left padding
        of prompt keys when their widths differ. All batches must have the same keys."""
        if not batches:
            raise BatchError("concat of no batches")
        keysets = {tuple(b.keys()) for b in batches}
        if len(keysets) > 1:
            raise BatchError(f"concat of batches with different keys: {sorted(keysets)}")
        tensors = {}
        for k in batches[0].tensors.keys():
            parts = [b.tensors[k] for b in batches]
            tensors[k] = _cat_padded(k, parts)
        nt = {k: [x for b in batches for x in b.non_tensors[k]] for k in batches[0].non_tensors}
        return Batch.from_dict(tensors, nt, dict(batches[0].meta))

    def repeat_interleave(self, n: int) -> Batch:
        """Each row n times in a row (n samples per prompt); ``uid`` repeats, so samples of one
        prompt share it. Requires a ``uid`` field (one per prompt)."""
        if n < 1:
            raise BatchError(f"repeat_interleave: n={n} must be >= 1")
        if "uid" not in self.non_tensors:
            raise BatchError("repeat_interleave needs a 'uid' field (one per prompt)")
        idx = torch.arange(len(self)).repeat_interleave(n)
        return self.index(idx)

    def groups(self) -> list[list[int]]:
        """Row indices of each ``uid`` group, in order of first appearance."""
        order: dict[Any, list[int]] = {}
        for i, u in enumerate(self.non_tensors["uid"]):
            order.setdefault(u, []).append(i)
        return list(order.values())

    def token_counts(self) -> list[int]:
        """Tokens per row: prompt + response mask sums where present, else 1."""
        total = torch.zeros(len(self), dtype=torch.long)
        for k in ("prompt_mask", "response_mask"):
            if k in self.tensors.keys():
                total += self.tensors[k].sum(-1)
        if not any(k in self.tensors.keys() for k in ("prompt_mask", "response_mask")):
            total += 1
        return total.tolist()

    def split_indices_by_groups(self, k: int, *, allow_empty: bool = False) -> list[list[int]]:
        """Row indices of k parts that never split a ``uid`` group, balancing token counts.

        Parts get equal group counts (±1, so data-parallel ranks stay in step), then groups go
        greedily, largest first, to the lightest part (LPT). Rows of a part keep their original
        order. With fewer groups than parts, the last ``k - groups`` parts are empty when
        ``allow_empty`` (the caller pads them, see :func:`padding_stand_in`), else BatchError.
        A batch without rows or groups always raises BatchError.
        """
        groups = self.groups()
        if k < 1 or not groups or (len(groups) < k and not allow_empty):
            raise BatchError(f"split_by_groups: {len(groups)} groups cannot fill {k} parts")
        tokens = self.token_counts()
        weights = [sum(tokens[i] for i in g) for g in groups]
        per_part = [len(groups) // k + (1 if r < len(groups) % k else 0) for r in range(k)]
        parts: list[list[int]] = [[] for _ in range(k)]
        load = [0] * k
        for gi in sorted(range(len(groups)), key=lambda g: -weights[g]):
            candidates = [r for r in range(k) if len(parts[r]) < per_part[r]]
            r = min(candidates, key=lambda r: (load[r], r))
            parts[r].append(gi)
            load[r] += weights[gi]
        return [sorted(i for g in p for i in groups[g]) for p in parts]

    def split_by_groups(self, k: int) -> list[Batch]:
        """Split into k batches by :meth:`split_indices_by_groups`."""
        return [self.index(idx) for idx in self.split_indices_by_groups(k)]

    def chunk(self, size: int) -> list[Batch]:
        """Consecutive chunks of ``size`` rows (the last may be smaller)."""
        return [self.index(range(s, min(s + size, len(self)))) for s in range(0, len(self), size)]

    def trim_padding(self) -> Batch:
        """The same rows without the columns that are padding in every row: prompt columns
        before the first real prompt token (left padding) and response columns after the last
        real response token (right padding; ``response_mask`` decides).

        Prompt keys (``prompt_ids``, ``prompt_mask``), response keys (``response_ids`` and
        :data:`RESPONSE_KEYS`) and ``position_ids`` ([B, P+R]) are sliced alike, so a forward
        pass over the trimmed rows computes the same values at every real position (positions
        come from the mask, and padded keys are masked out of attention) on fewer tokens — what
        verl's remove-padding does for micro-batches. At least one column of each is kept.
        Returns ``self`` unchanged when nothing can be trimmed, when prompt/response masks are
        missing, or when another tensor key is 2-D with a prompt/response/sequence width (its
        alignment is unknown, so trimming it could misalign it).
        """
        if "prompt_mask" not in self.tensors.keys() or "response_mask" not in self.tensors.keys():
            return self
        pm, rm = self.tensors["prompt_mask"], self.tensors["response_mask"]
        p_len, r_len = pm.shape[1], rm.shape[1]
        real_p, real_r = pm.any(0).nonzero(), rm.any(0).nonzero()
        first = min(int(real_p[0]), p_len - 1) if len(real_p) else p_len - 1
        last = max(int(real_r[-1]) + 1, 1) if len(real_r) else 1
        if first == 0 and last == r_len:
            return self
        out = {}
        for k, v in self.tensors.items():
            if k in _PROMPT_KEYS:
                out[k] = v[:, first:]
            elif k == "response_ids" or k in RESPONSE_KEYS:
                out[k] = v[:, :last]
            elif k == "position_ids":
                out[k] = v[:, first : p_len + last]
            elif v.dim() >= 2 and v.shape[1] in (p_len, r_len, p_len + r_len):
                return self
            else:
                out[k] = v
        return Batch(TensorDict(out, batch_size=self.tensors.batch_size),
                     {k: list(v) for k, v in self.non_tensors.items()}, dict(self.meta))

    # ---- storage -----------------------------------------------------------------------------
    def _serialise(self) -> tuple[bytes, bytes]:
        tensor_bytes = st_save(_unshared(dict(self.tensors.items()))) if len(self.tensors.keys()) else b""
        doc = {"rows": len(self), "non_tensors": self.non_tensors, "meta": self.meta}
        json_bytes = json.dumps(doc, sort_keys=True, allow_nan=False).encode()
        return tensor_bytes, json_bytes

    def save(self, uri: str, *, run_id: str = "", iteration: int = 0, node: str = "") -> BatchRef:
        """Write ``uri.safetensors`` + ``uri.json`` (fsspec; parents created) and return a BatchRef.

        Files are written to a temporary name and moved into place, so a reader never sees a
        half-written batch on filesystems with atomic rename. Non-tensor values must be JSON.
        """
        tensor_bytes, json_bytes = self._serialise()
        checksum = hashlib.sha256(tensor_bytes + b"\0" + json_bytes).hexdigest()
        fs, path = fsspec.core.url_to_fs(uri)
        parent = path.rsplit("/", 1)[0] if "/" in path else ""
        if parent:
            fs.makedirs(parent, exist_ok=True)
        for suffix, data in ((".safetensors", tensor_bytes), (".json", json_bytes)):
            tmp = f"{path}{suffix}.tmp"
            with fs.open(tmp, "wb") as f:
                f.write(data)
            fs.mv(tmp, path + suffix)
        return BatchRef(run_id, iteration, node, uri, len(self), tuple(self.keys()), checksum)

    @classmethod
    def load(cls, uri: str, *, expected_checksum: str | None = None) -> Batch:
        """Read a batch saved by :meth:`save`. Raises FileNotFoundError, or BatchError when the
        checksum does not match (the files changed since the ref was made)."""
        fs, path = fsspec.core.url_to_fs(uri)
        with fs.open(path + ".safetensors", "rb") as f:
            tensor_bytes = f.read()
        with fs.open(path + ".json", "rb") as f:
            json_bytes = f.read()
        if expected_checksum is not None:
            got = hashlib.sha256(tensor_bytes + b"\0" + json_bytes).hexdigest()
            if got != expected_checksum:
                raise BatchError(f"batch at {uri} changed since it was referenced (checksum mismatch)")
        doc = json.loads(json_bytes)
        tensors = st_load(tensor_bytes) if tensor_bytes else {}
        td = TensorDict(tensors, batch_size=[doc["rows"]])
        return cls(td, doc["non_tensors"], doc["meta"])


PADDING_META_KEY = "dp_padding"


def padding_stand_in(batch: Batch, rows: Sequence[int]) -> Batch:
    """A copy of ``batch``'s ``rows`` marked as data-parallel padding (``meta["dp_padding"]``).

    A rank whose share of a batch is empty (fewer ``uid`` groups than ranks) gets a stand-in
    instead of nothing, so it runs the same forward/backward passes and collectives as the
    others (what verl's ``pad_dataproto_to_divisor`` pads for). Workers give a stand-in zero
    weight — no loss, gradient, row count or metric comes from it (:func:`is_padding`) — and
    the dispatcher drops what it returns.
    """
    out = batch.index(rows)
    out.meta[PADDING_META_KEY] = True
    return out


def is_padding(batch: Batch) -> bool:
    """True for a stand-in made by :func:`padding_stand_in` (every row is padding)."""
    return bool(batch.meta.get(PADDING_META_KEY, False))


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors with no shared storage (safetensors refuses aliases, e.g. rewards that
    are the scores when no KL is applied)."""
    seen: set[int] = set()
    out = {}
    for k in sorted(tensors):
        v = tensors[k].contiguous()
        ptr = v.untyped_storage().data_ptr()
        if ptr in seen and v.numel():
            v = v.clone()
        seen.add(v.untyped_storage().data_ptr())
        out[k] = v
    return out


def _cat_padded(key: str, parts: list[torch.Tensor]) -> torch.Tensor:
    if parts[0].dim() < 2 or len({p.shape[1:] for p in parts}) == 1:
        return torch.cat(parts, 0)
    width = max(p.shape[1] for p in parts)
    left = key.startswith("prompt")
    if key == "position_ids":
        raise BatchError("concat: position_ids of different widths; recompute them after concat")
    out = []
    for p in parts:
        pad = width - p.shape[1]
        fill = torch.zeros((p.shape[0], pad, *p.shape[2:]), dtype=p.dtype)
        out.append(torch.cat([fill, p] if left else [p, fill], 1))
    return torch.cat(out, 0)


__all__ = ["Batch", "BatchRef", "BatchError", "KEY_DTYPES", "RESPONSE_KEYS", "PADDING_META_KEY", "is_padding",
           "padding_stand_in"]
