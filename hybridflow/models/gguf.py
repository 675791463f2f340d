"""GGUF → plain safetensors Hugging Face folder, cached by the file's content hash.

transformers dequantises a GGUF file with ``from_pretrained(folder, gguf_file=name)``, but
the model it returns is flagged as quantized (``config.quantization_config`` = GgufConfig,
an ``hf_quantizer``) and refuses ``save_pretrained``. So: load it, rebuild the architecture
from its config without ``quantization_config``, load the state dict (tied embeddings stay
tied), check that both give bit-identical logits, and save that plain model and the
tokenizer to ``$HYBRIDFLOW_CACHE/gguf/<sha256(file)[:16]>/`` (default cache root
``~/.cache/hybridflow``), atomically. Later loads read the cache (seconds, not ~a minute).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from hybridflow.cache import CACHE_ENV, cache_root  # noqa: F401  (re-exported)
from hybridflow.models.fsutil import atomic_directory

MARKER = "hybridflow_gguf.json"


def file_sha256(path: str | Path, *, chunk_bytes: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def gguf_cache_dir(gguf_path: str | Path) -> Path:
    """Where the plain HF copy of this GGUF file lives: ``<cache_root>/gguf/<sha256[:16]>``."""
    return cache_root() / "gguf" / file_sha256(gguf_path)[:16]


@contextmanager
def _memoized_gguf_parsing() -> Iterator[None]:
    """Within the block, reuse gguf's tensor-name maps and file readers.

    transformers builds ``gguf.get_tensor_name_map`` once per submodule (hundreds of times,
    ~0.1 s each) and parses the file's metadata twice; both are pure functions of their
    arguments, so memoising them cuts the first load by tens of seconds. Restored on exit.
    """
    import gguf

    orig_map, orig_reader = gguf.get_tensor_name_map, gguf.GGUFReader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(orig_map)
    readers: dict[tuple[str, str], object] = {}

    def reader(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = orig_reader(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.get_tensor_name_map, gguf.GGUFReader = orig_map, orig_reader


def dequantize_gguf(gguf_path: str | Path) -> PreTrainedModel:
    """Load a GGUF file with transformers (float32) and return a plain, unquantized copy.

    Raises RuntimeError when the rebuilt model's logits differ from the GGUF-loaded model's
    or when tied embeddings came apart.
    """
    path = Path(gguf_path)
    with _memoized_gguf_parsing():
        quantized = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    plain = rebuild_without_quantization(quantized)
    _check_same_logits(quantized, plain)
    return plain


def rebuild_without_quantization(model: PreTrainedModel) -> PreTrainedModel:
    """The same architecture and weights, built from a config without ``quantization_config``."""
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    plain.load_state_dict(state, strict=True, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        plain.tie_weights()
        if plain.get_output_embeddings().weight is not plain.get_input_embeddings().weight:
            raise RuntimeError("tied embeddings came apart while rebuilding the GGUF model")
    _materialize_meta_buffers(plain, model)
    plain.generation_config = copy.deepcopy(model.generation_config)
    return plain.eval()


def _materialize_meta_buffers(plain: PreTrainedModel, source: PreTrainedModel) -> None:
    """Non-persistent buffers (rotary inv_freq, ...) are not in a state dict: copy them over."""
    src = dict(source.named_buffers())
    for name, buf in list(plain.named_buffers()):
        if buf.is_meta:
            owner, _, leaf = name.rpartition(".")
            module = plain.get_submodule(owner) if owner else plain
            module.register_buffer(leaf, src[name].detach().clone(), persistent=False)


def _check_same_logits(a: PreTrainedModel, b: PreTrainedModel) -> None:
    ids = torch.arange(1, 17).unsqueeze(0) % a.config.vocab_size
    with torch.no_grad():
        la, lb = a.eval()(input_ids=ids).logits, b.eval()(input_ids=ids).logits
    if not torch.equal(la, lb):
        raise RuntimeError(f"GGUF rebuild changed the logits (max abs diff {(la - lb).abs().max().item():.3g})")


def convert_gguf(gguf_path: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The plain (unquantized, float32) model and the tokenizer of a GGUF file, not cached."""
    path = Path(gguf_path)
    with _memoized_gguf_parsing():  # one parse of the file serves the model and the tokenizer
        plain = dequantize_gguf(path)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return plain, tokenizer


def materialize_gguf(gguf_path: str | Path) -> Path:
    """The cached plain HF folder (model + tokenizer) for a GGUF file; converted on first use.

    Safe against concurrent converters: each writes its own temporary folder, the first
    rename wins, the others discard their copy. Returns the folder.
    """
    path = Path(gguf_path).resolve()
    target = gguf_cache_dir(path)
    if (target / MARKER).is_file():
        return target
    plain, tokenizer = convert_gguf(path)
    with atomic_directory(target, on_exists="keep") as tmp:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        info = {"gguf_file": str(path), "sha256": file_sha256(path), "torch_dtype": "float32"}
        (tmp / MARKER).write_text(json.dumps(info, indent=1))
    return target
