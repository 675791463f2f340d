"""reasoning-gym tasks as verl-format rows (data_source ``reasoning_gym/<dataset>``).

reasoning-gym (PyPI ``reasoning-gym``, pinned to :data:`PINNED_VERSION`) holds ~100 procedural
generators, each with its own verifier ``dataset.score_answer(answer, entry)``. This module turns
its entries into rows and gives the reward (:mod:`hybridflow.rewards.reasoning_gym`) what it needs
to call that verifier again:

- ``prompt``: one user message, the entry's question followed by :data:`INSTRUCTION` (the final
  answer between ``<answer>`` and ``</answer>``, as reasoning-gym's own system prompts ask), or with
  ``answer_format="boxed"`` :data:`BOXED_INSTRUCTION` (``\\boxed{}``, which small instruct models trained
  on math write far more readily than tags).
- ``reward_model.ground_truth``: the entry's oracle answer (a string).
- ``extra_info``: ``dataset``, ``seed`` (hybridflow's), ``split``, ``index`` (within the dataset),
  ``reasoning_gym_version``, ``answer_format`` ("tags" | "boxed"; rows without it are "tags"),
  ``config`` (the ``--config`` overrides) and ``entry`` (the whole
  entry: question, answer, metadata). ``config`` and ``entry`` are JSON *strings* (:func:`encode`):
  entries of different datasets have different metadata, which one parquet struct column cannot
  hold, and tuples and non-string dict keys survive the round trip, since some verifiers compare
  them (arc_agi's grids are tuples of tuples).

Seeds: reasoning-gym generates item ``i`` from ``Random(seed + i)``, so its seeds 0 and 1 give the
same items shifted by one. The seed handed to it is a hash of (``seed``, dataset, split), so
``--seed 0`` and ``--seed 1`` (and the train and test splits) draw from far-apart streams; the
held-out split additionally drops every question of the train split.

Several datasets are interleaved: row ``i`` comes from ``datasets[i % k]``, item ``i // k``, so a
longer file starts with the rows of a shorter one. reasoning-gym is imported only inside the
functions (it pulls in sympy and matplotlib).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import hashlib
import json
from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import Any

PINNED_VERSION = "0.1.25"  # keep equal to pyproject.toml's reasoning-gym pin
INSTRUCTION = "Give only the final answer between <answer> and </answer> tags."
BOXED_INSTRUCTION = "Put the final answer in \\boxed{}."
ANSWER_FORMATS = ("tags", "boxed")  # what the prompt asks for; extra_info.answer_format tells the reward
RESERVED_KEYS = ("seed", "size")  # set by --seed and --n


class ReasoningGymError(ValueError):
    """Bad reasoning-gym input (missing package, wrong version, unknown dataset or config key);
    the message is one line naming the offending value."""


def require_reasoning_gym() -> None:
    """Raise ReasoningGymError unless reasoning-gym ``PINNED_VERSION`` is installed.

    The installed distribution's version is read from its metadata (the package's own
    ``__version__`` string says 0.1.19 in 0.1.25)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("reasoning-gym")
    except PackageNotFoundError:
        raise ReasoningGymError(f"reasoning-gym is not installed; pip install reasoning-gym=={PINNED_VERSION}") from None
    if found != PINNED_VERSION:
        raise ReasoningGymError(f"reasoning-gym {found} is installed; hybridflow needs {PINNED_VERSION} "
                                f"(pip install reasoning-gym=={PINNED_VERSION})")  # fmt: skip


def dataset_names() -> list[str]:
    """Every dataset registered by the installed reasoning-gym, sorted."""
    require_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def config_defaults(name: str) -> dict[str, Any]:
    """{key: default} of dataset ``name``'s config dataclass (``seed`` and ``size`` left out).

    Raises ReasoningGymError for an unknown name, listing the known ones."""
    names = dataset_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ReasoningGymError(f"unknown reasoning-gym dataset {name!r}{hint}; known: {', '.join(names)}")
    from reasoning_gym.factory import DATASETS

    out = {}
    for f in dataclasses.fields(DATASETS[name][1]):
        if f.init and f.name not in RESERVED_KEYS:
            has_factory = f.default_factory is not dataclasses.MISSING
            out[f.name] = f.default_factory() if has_factory else (None if f.default is dataclasses.MISSING else f.default)
    return out


def parse_overrides(names: Sequence[str], items: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``--config`` items → {dataset: {key: value}} for each of ``names``.

    ``key=value`` applies to every listed dataset (each must have the key); ``dataset.key=value``
    to that one. Values are Python literals (``3``, ``0.5``, ``True``, ``('+', '-')``), else
    strings; a list or a comma-separated string becomes a tuple where the default is a tuple, an
    int a float where the default is a float. Raises ReasoningGymError naming an unknown dataset,
    an unknown key (with the dataset's keys), ``seed``/``size`` (use --seed/--n) or an item
    without ``=``.
    """
    defaults = {name: config_defaults(name) for name in names}
    out: dict[str, dict[str, Any]] = {name: {} for name in names}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ReasoningGymError(f"--config {item!r}: expected key=value or dataset.key=value")
        target, _, short = key.rpartition(".")
        if target and target not in defaults:
            raise ReasoningGymError(f"--config {item!r}: dataset {target!r} is not among --dataset {','.join(names)}")
        if short in RESERVED_KEYS:
            raise ReasoningGymError(f"--config {item!r}: {short} is set by --{'seed' if short == 'seed' else 'n'}")
        for name in [target] if target else names:
            if short not in defaults[name]:
                raise ReasoningGymError(f"reasoning-gym dataset {name!r} has no config key {short!r}; "
                                        f"its keys: {', '.join(defaults[name])}")  # fmt: skip
            out[name][short] = _coerce(defaults[name][short], raw)
    return out


def _coerce(default: Any, raw: str) -> Any:
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    if isinstance(default, tuple) and isinstance(value, str):
        return tuple(v.strip() for v in value.split(","))
    if isinstance(default, tuple) and isinstance(value, list):
        return tuple(value)
    if isinstance(default, float) and type(value) is int:
        return float(value)
    return value


def rg_seed(seed: int, name: str, split: str) -> int:
    """The seed handed to reasoning-gym for (hybridflow seed, dataset, split): 31 bits of a SHA-256."""
    digest = hashlib.sha256(f"reasoning_gym/{name}/{split}/{seed}".encode()).digest()
    return int.from_bytes(digest[:4], "big") >> 1


@lru_cache(maxsize=64)
def _dataset(name: str, config_json: str, seed: int, size: int) -> Any:
    import reasoning_gym

    kwargs = decode(config_json)
    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size, **kwargs)
    except (AssertionError, ValueError, TypeError) as e:
        raise ReasoningGymError(f"reasoning-gym dataset {name!r} rejects config {kwargs}: {e}") from None


def scorer(name: str, config_json: str) -> Any:
    """The dataset object whose ``score_answer`` judges rows of ``name`` generated with these
    overrides (cached per process; seed and size do not matter for scoring)."""
    require_reasoning_gym()
    return _dataset(name, config_json, 0, 1)


def make_reasoning_gym(datasets: Sequence[str], n: int, *, seed: int, overrides: dict[str, dict[str, Any]] | None = None,
                       split: str = "train", answer_format: str = "tags") -> list[dict[str, Any]]:  # fmt: skip
    """``n`` verl-format rows interleaved from ``datasets`` (module docstring), seeded.

    overrides: {dataset: {config key: value}} (:func:`parse_overrides`). Raises ReasoningGymError
    for an unknown dataset or key, a config the dataset rejects, a dataset without a single
    oracle answer (its ``answer`` is None: boxnet, rush_hour, ...) or an entry that does not
    survive the JSON round trip; ValueError for n < 0, no dataset or an answer_format not in
    :data:`ANSWER_FORMATS`.
    """
    return list(iter_reasoning_gym(datasets, n, seed=seed, overrides=overrides, split=split, answer_format=answer_format))


def iter_reasoning_gym(datasets: Sequence[str], n: int, *, seed: int, overrides: dict[str, dict[str, Any]] | None = None,
                       split: str = "train", answer_format: str = "tags") -> Iterator[dict[str, Any]]:  # fmt: skip
    """The rows of :func:`make_reasoning_gym`, lazily (checks run before the first row)."""
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer format {answer_format!r}: one of {', '.join(ANSWER_FORMATS)}")
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    if not datasets:
        raise ValueError("no reasoning-gym dataset given")
    overrides = overrides if overrides is not None else parse_overrides(datasets, [])
    k = len(datasets)
    made = []
    for j, name in enumerate(datasets):
        config_defaults(name)  # unknown name → error before generating
        unknown = set(overrides.get(name, {})) - set(config_defaults(name))
        if unknown:
            raise ReasoningGymError(f"reasoning-gym dataset {name!r} has no config key {sorted(unknown)[0]!r}")
        size = max(1, (n - j + k - 1) // k)
        config_json = encode(overrides.get(name, {}))
        made.append((name, config_json, _dataset(name, config_json, rg_seed(seed, name, split), size)))
    return _rows(made, n, seed, split, answer_format)


def _rows(made: list[tuple[str, str, Any]], n: int, seed: int, split: str, answer_format: str) -> Iterator[dict[str, Any]]:
    for i in range(n):
        name, config_json, ds = made[i % len(made)]
        index = i // len(made)
        entry = ds[index]
        yield _row(name, config_json, entry, seed, split, index, answer_format)


def _row(name: str, config_json: str, entry: dict[str, Any], seed: int, split: str, index: int,
         answer_format: str = "tags") -> dict[str, Any]:  # fmt: skip
    if entry.get("answer") is None:
        raise ReasoningGymError(f"reasoning-gym dataset {name!r} has no single oracle answer (only a verifier); "
                                "not supported as a data task")  # fmt: skip
    encoded = encode(entry)
    if decode(encoded) != entry:
        raise ReasoningGymError(f"reasoning-gym dataset {name!r}: entry {index} does not survive the JSON round trip")
    return {
        "data_source": f"reasoning_gym/{name}",
        "prompt": [{"role": "user", "content": f"{entry['question'].rstrip()}\n\n"
                                               f"{BOXED_INSTRUCTION if answer_format == 'boxed' else INSTRUCTION}"}],
        "ability": "reasoning",
        "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
        "extra_info": {"generator": "reasoning_gym", "reasoning_gym_version": PINNED_VERSION, "dataset": name,
                       "seed": seed, "split": split, "index": index, "answer_format": answer_format,
                       "config": config_json, "entry": encoded},
    }  # fmt: skip


def encode(value: Any) -> str:
    """JSON text of ``value`` in which tuples and dicts with non-string keys are tagged, so
    :func:`decode` gives back an equal value. Raises TypeError for anything else JSON cannot hold."""
    return json.dumps(_tag(value), ensure_ascii=False)


def decode(text: str) -> Any:
    """The value :func:`encode` wrote."""
    return _untag(json.loads(text))


def _tag(v: Any) -> Any:
    if isinstance(v, tuple):
        return {"__tuple__": [_tag(x) for x in v]}
    if isinstance(v, list):
        return [_tag(x) for x in v]
    if isinstance(v, dict):
        if all(isinstance(k, str) for k in v) and "__tuple__" not in v and "__items__" not in v:
            return {k: _tag(x) for k, x in v.items()}
        return {"__items__": [[_tag(k), _tag(x)] for k, x in v.items()]}
    return v


def _untag(v: Any) -> Any:
    if isinstance(v, list):
        return [_untag(x) for x in v]
    if isinstance(v, dict):
        if set(v) == {"__tuple__"}:
            return tuple(_untag(x) for x in v["__tuple__"])
        if set(v) == {"__items__"}:
            return {_untag(k): _untag(x) for k, x in v["__items__"]}
        return {k: _untag(x) for k, x in v.items()}
    return v


__all__ = [
    "PINNED_VERSION",
    "ANSWER_FORMATS",
    "BOXED_INSTRUCTION",
    "INSTRUCTION",
    "ReasoningGymError",
    "require_reasoning_gym",
    "dataset_names",
    "config_defaults",
    "parse_overrides",
    "make_reasoning_gym",
    "iter_reasoning_gym",
    "rg_seed",
    "scorer",
    "encode",
    "decode",
]
