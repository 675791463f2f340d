"""Preflight of the inputs themselves, before any server or pool starts (issue 40, defects 5-7):
what ``hybridflow train``, ``hybridflow eval`` and ``hybridflow node run`` (and their flows) load.

- **model**: a model folder's ``config.json`` loads (an unknown ``model_type`` is one line); its
  tokenizer files are there; its weights match the checkpoint manifest when the folder is a
  checkpoint's ``policy/`` (sizes, :func:`workers.checkpoint_integrity.verify_checkpoint`), else
  every ``*.safetensors`` file's header parses and its tensors fit in the file; a ``.gguf`` file's
  header parses and its tensor data fits in the file (:func:`gguf_summary`);
- **data**: every ``.jsonl`` file decodes as UTF-8 (unless ``data.on_bad_row=skip``: the loader
  then skips the bad rows and counts them);
- **disk**: the run folder has free space for the Prefect home (when a local server starts),
  one checkpoint (its size from the model's parameter count and dtype, plus the optimizer's two
  float32 moments) and 10 % more.

Every failure is one :class:`~flows.preflight.PreflightError` line naming the key and the value.
Kept apart from :mod:`flows.preflight` (which calls :func:`check_inputs`) so the engine checks
there and these input checks grow independently.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.config import ExperimentConfig

#: What a local Prefect server's home (its SQLite db) may take during a run.
PREFECT_HOME_BYTES = 128 << 20
#: Free space beyond the estimate.
HEADROOM = 0.10
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_ADAM_BYTES = 8  # two float32 moments per parameter in the checkpoint's optimizer state
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")


def _error(line: str) -> Exception:
    from flows.preflight_base import PreflightError

    return PreflightError(line)


# ---- weights ---------------------------------------------------------------------------------
def safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a readable safetensors file (header length, JSON header, tensor data
    within the file), or None. Reads the header only."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes: too short for a safetensors header"
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            return f"its header claims {n} bytes but the file has {size} (truncated?)"
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            return f"its header is not JSON ({e})"
    end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        return f"its tensors need {8 + n + end} bytes but the file has {size} (truncated)"
    return None


@dataclass(frozen=True)
class GGUFSummary:
    """A GGUF file's header: parameters (elements of every tensor) and bytes its data needs."""

    parameters: int
    needed_bytes: int


def gguf_summary(path: Path) -> GGUFSummary:
    """Parse a GGUF (v2/v3) header: key-values (skipped, except ``general.alignment``) and tensor
    infos. Raises ValueError naming what is wrong (bad magic, a header past the end of the file)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    data = _head(path, 32 << 20)  # the header (vocabulary included) is a few MB
    r = _Reader(data)
    if r.take(4) != b"GGUF":
        raise ValueError("not a GGUF file (bad magic)")
    version, n_tensors, n_kv = r.u32(), r.u64(), r.u64()
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported")
    alignment = 32
    for _ in range(n_kv):
        key, value = r.string(), r.value(r.u32())
        if key == "general.alignment":
            alignment = int(value)
    params, end = 0, 0
    for _ in range(n_tensors):
        r.string()
        dims = [r.u64() for _ in range(r.u32())]
        kind, offset = r.u32(), r.u64()
        count = 1
        for d in dims:
            count *= d
        block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        params += count
        end = max(end, offset + count // block * type_bytes)
    start = -(-r.pos // alignment) * alignment
    return GGUFSummary(params, start + end)


def _head(path: Path, n: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


class _Reader:
    """Little-endian GGUF fields from ``data``; ValueError when a field runs past its end."""

    _SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError(f"the header ends early, at byte {len(self.data)} (truncated)")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.take(8))[0])

    def string(self) -> str:
        return self.take(self.u64()).decode("utf-8", "replace")

    def value(self, kind: int) -> Any:
        if kind in self._SCALARS:
            fmt = self._SCALARS[kind]
            return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]
        if kind == 8:
            return self.string()
        if kind == 9:
            item, n = self.u32(), self.u64()
            return [self.value(item) for _ in range(n)]
        raise ValueError(f"unknown GGUF value type {kind}")


# ---- model folders ---------------------------------------------------------------------------
def check_model(key: str, value: str, *, tokenizer: bool) -> int | None:
    """``value`` (what ``key`` names) is a model that loads: config, weights and (``tokenizer``)
    tokenizer files. Returns its parameter count where cheap to know (GGUF header, HF config on
    the meta device), else None. Raises PreflightError (one line)."""
    from hybridflow.models.resolve import resolve_model_path

    try:
        resolved = resolve_model_path(value)
    except (FileNotFoundError, ValueError) as e:
        raise _error(f"{key}={value!r}: {e}") from None
    if resolved.is_gguf:
        try:
            summary = gguf_summary(resolved.path)
        except (ValueError, KeyError, OSError) as e:
            raise _error(f"{key}={value!r}: {resolved.path} is not a readable GGUF file: {e}") from None
        if summary.needed_bytes > resolved.path.stat().st_size:
            raise _error(f"{key}={value!r}: {resolved.path} is truncated: its tensors need {summary.needed_bytes} "
                         f"bytes, the file has {resolved.path.stat().st_size}")  # fmt: skip
        return summary.parameters
    if resolved.path is None:  # "tiny": built in memory
        return None
    folder = Path(resolved.path)
    config = _load_config(key, value, folder)
    _check_weights(key, value, folder)
    if tokenizer and not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        raise _error(f"{key}={value!r}: no tokenizer in {folder} (none of {', '.join(_TOKENIZER_FILES)}); "
                     "add the tokenizer files or set model.tokenizer_path")  # fmt: skip
    return _parameter_count(config)


def _load_config(key: str, value: str, folder: Path) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder)
    except (ValueError, KeyError, OSError) as e:
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise _error(f"{key}={value!r}: {folder / 'config.json'} does not load: {first}") from None


def _check_weights(key: str, value: str, folder: Path) -> None:
    from workers.checkpoint_files import MANIFEST

    if (folder.parent / MANIFEST).is_file():  # a checkpoint's policy/ folder: its manifest says what it holds
        from workers.checkpoint_integrity import CheckpointDamagedError, verify_checkpoint

        try:
            verify_checkpoint(folder.parent, hashes=False)
        except CheckpointDamagedError as e:
            raise _error(f"{key}={value!r}: {e}") from None
        return
    tensors = sorted(folder.glob("*.safetensors"))
    if not tensors and not any(folder.glob("pytorch_model*.bin")):
        raise _error(f"{key}={value!r}: no weights in {folder} (no *.safetensors or pytorch_model*.bin)")
    for f in tensors:
        if (problem := safetensors_problem(f)) is not None:
            raise _error(f"{key}={value!r}: {f} is not a readable safetensors file: {problem}")


def _parameter_count(config: Any) -> int | None:
    """Parameters of the model ``config`` describes (built on the meta device: no memory)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return sum(p.numel() for p in model.parameters())
    except Exception:  # noqa: BLE001 - an architecture without a causal-LM head: the size stays unknown
        return None


# ---- data ------------------------------------------------------------------------------------
def check_data_decodable(key: str, files: list[str], on_bad_row: str) -> None:
    """Every local ``.jsonl`` file of ``files`` is UTF-8, line by line; the first line that is not
    is named (file:line). Skipped with ``on_bad_row='skip'`` (the loader skips such rows)."""
    if on_bad_row == "skip":
        return
    for path in files:
        p = Path(path)
        if not (p.suffix in (".jsonl", ".json") and p.is_file()):
            continue
        with open(p, "rb") as f:
            for lineno, line in enumerate(f, 1):
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise _error(f"{key}: {path}:{lineno} is not UTF-8 text (byte 0x{line[e.start]:02x} at column "
                                 f"{e.start + 1}); fix the file or set data.on_bad_row=skip") from None  # fmt: skip


# ---- disk ------------------------------------------------------------------------------------
def checkpoint_bytes(cfg: ExperimentConfig, parameters: int | None) -> int:
    """One checkpoint: each trained model's weights in the run's parameter dtype
    (:func:`hybridflow.precision.resolved_precision`) plus two float32 optimizer
    moments per parameter (the critic, when there is one, counted like the policy)."""
    from hybridflow.precision import resolved_precision

    if not parameters:
        return 0
    try:
        weight_bytes = _DTYPE_BYTES[resolved_precision(cfg).param_dtype]
    except (ValueError, KeyError):  # a precision the config refuses elsewhere: count float32
        weight_bytes = 4
    per_model = parameters * (weight_bytes + _ADAM_BYTES)
    return per_model * (2 if cfg.needs_critic else 1)


def check_free_space(folder: Path, needed_bytes: int, what: str) -> None:
    """``folder`` has ``needed_bytes`` × (1 + HEADROOM) free, else one line naming "No space left"."""
    need = int(needed_bytes * (1 + HEADROOM))
    free = shutil.disk_usage(folder).free
    if free < need:
        raise _error(f"trainer.run_dir={str(folder)!r}: No space left on device for this run: {free / 2**20:.0f} MiB "
                     f"free, {need / 2**20:.0f} MiB needed ({what} + 10 %); free space or point trainer.run_dir "
                     "elsewhere")  # fmt: skip


def run_disk_need(cfg: ExperimentConfig, parameters: int | None, *, checkpoints: bool,
                  prefect: bool = True) -> tuple[int, str]:  # fmt: skip
    """(bytes, what they are for) a run needs in its folder: the Prefect home when a local server
    starts (``prefect`` and no PREFECT_API_URL), plus one checkpoint when the command writes them."""
    parts = []
    total = 0
    if prefect and not os.environ.get("PREFECT_API_URL"):
        total += PREFECT_HOME_BYTES
        parts.append(f"Prefect home {PREFECT_HOME_BYTES >> 20} MiB")
    if checkpoints and (ckpt := checkpoint_bytes(cfg, parameters)):
        total += ckpt
        parts.append(f"one checkpoint {ckpt / 2**20:.0f} MiB")
    return total, " + ".join(parts) or "nothing"


# ---- all of it -------------------------------------------------------------------------------
def check_inputs(cfg: ExperimentConfig, *, data_files: list[tuple[str, list[str]]] | None = None,
                 checkpoints: bool = True, prefect: bool = True) -> None:  # fmt: skip
    """The model (config, weights, tokenizer), the data's encoding and the run folder's free space
    for ``cfg`` (its run folder must exist). ``data_files``: (key, files) pairs (default: the
    config's train and val files); ``checkpoints``: the command writes checkpoints (train);
    ``prefect``: the command starts Prefect."""
    parameters = check_model("model.path", cfg.model.path, tokenizer=cfg.model.tokenizer_path is None)
    if cfg.model.tokenizer_path is not None:
        check_model_tokenizer("model.tokenizer_path", cfg.model.tokenizer_path)
    if cfg.reward.judge.enable and cfg.reward.judge.path is not None:
        check_model("reward.judge.path", cfg.reward.judge.path, tokenizer=True)
    if data_files is None:
        data_files = [("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)]
    for key, files in data_files:
        check_data_decodable(key, list(files), cfg.data.on_bad_row)
    need, what = run_disk_need(cfg, parameters, checkpoints=checkpoints, prefect=prefect)
    check_free_space(Path(cfg.trainer.run_dir), need, what)


def check_resume_files(run_dir: str | Path) -> None:
    """A resumed run folder's ``run.json`` is a JSON object (what the run recorded: its MLflow run,
    its Prefect flow run, its overrides); a damaged one is one line, not a traceback later. Its
    run format is one this code reads (:func:`check_run_format`)."""
    from flows.run_dir import RunDir

    folder = RunDir(Path(run_dir))
    try:
        info = folder.run_info()
    except ValueError as e:  # json.JSONDecodeError is one
        what = f"{e.msg} at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
        raise _error(f"--resume {run_dir}: {folder.run_info_file} is damaged ({what}); restore it from a backup "
                     "or start a new run") from None  # fmt: skip
    except UnicodeDecodeError as e:
        raise _error(f"--resume {run_dir}: {folder.run_info_file} is not UTF-8 text ({e.reason})") from None
    check_run_format(run_dir, info)


def check_run_format(run_dir: str | Path, info: dict[str, Any]) -> None:
    """The run folder ``run_dir`` (its ``run.json`` as ``info``) was written in a run format this
    hybridflow reads: ``run_format`` 1..:data:`hybridflow.layout.RUN_FORMAT` (absent: 1, a folder
    from before the format was recorded). A newer or unknown format (another hybridflow wrote it) is
    one line naming the folder, the version and format that wrote it and ours (PreflightError)."""
    from hybridflow import __version__
    from hybridflow.layout import RUN_FORMAT

    fmt = info.get("run_format", 1)
    if isinstance(fmt, int) and not isinstance(fmt, bool) and 1 <= fmt <= RUN_FORMAT:
        return
    wrote = info.get("hybridflow_version", "an unknown version")
    raise _error(f"--resume {run_dir}: this run folder was written by hybridflow {wrote} in run format {fmt!r}; this "
                 f"hybridflow {__version__} reads run formats 1 to {RUN_FORMAT}: resume it with the hybridflow that "
                 "wrote it, or start a new run")  # fmt: skip


def preflight_eval(target: Any, cfg: ExperimentConfig) -> None:
    """``hybridflow eval``'s (and the evaluate flow's) input checks for ``target`` (an
    :class:`flows.eval_plan.EvalTarget`) under its eval config: the folder the generations go to
    is writable, the rollout engine can run (:func:`flows.preflight.check_engine`), then
    :func:`check_inputs` on the evaluation data (no checkpoint is written)."""
    from flows.preflight_base import check_run_dir

    folder = Path(target.run_dir) / "evals" if target.run_dir else Path(cfg.trainer.run_dir) / "evals"
    cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"run_dir": str(folder)})})
    from flows.preflight_base import check_engine

    check_run_dir(cfg)
    check_engine(cfg)  # rollout.engine=vllm: its runtime, the CPU, the KV cache
    check_inputs(cfg, data_files=[("--data", cfg.data.val_files)], checkpoints=False)


def check_model_tokenizer(key: str, value: str) -> None:
    """A ``model.tokenizer_path`` folder holds tokenizer files (a GGUF carries its own)."""
    from hybridflow.models.resolve import resolve_model_path

    try:
        resolved = resolve_model_path(value)
    except (FileNotFoundError, ValueError) as e:
        raise _error(f"{key}={value!r}: {e}") from None
    if resolved.path is not None and not resolved.is_gguf:
        if not any((Path(resolved.path) / f).is_file() for f in _TOKENIZER_FILES):
            raise _error(f"{key}={value!r}: no tokenizer in {resolved.path} (none of {', '.join(_TOKENIZER_FILES)})")


__all__ = ["PREFECT_HOME_BYTES", "GGUFSummary", "gguf_summary", "safetensors_problem", "check_model",
           "check_data_decodable", "checkpoint_bytes", "check_free_space", "run_disk_need", "check_inputs",
           "check_model_tokenizer", "check_resume_files", "check_run_format", "preflight_eval"]  # fmt: skip
