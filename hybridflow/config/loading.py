"""Loading: YAML file + dotted overrides -> a validated :class:`ExperimentConfig`, with readable
ConfigError lines; flattening and dumping."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from hybridflow.config.base import (
    ConfigError,
)
from hybridflow.config.experiment import (
    ExperimentConfig,
)
from hybridflow.config.placement import (
    _default_pools,
)

_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")

# ---- loading ------------------------------------------------------------------------------------


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn ``["actor.lr=2e-6", "data.train_files=[a.parquet]"]`` into a nested dict.

    Values are parsed as YAML scalars/lists (``1e-6`` → float, ``true`` → bool, ``[a, b]`` → list).
    Raises ConfigError for an item without ``=`` or with an empty key.
    """
    out: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key.path=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {item!r}: empty key segment")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
            if isinstance(value, str) and _FLOAT_RE.fullmatch(value):  # YAML 1.1 reads 2e-6 as a string
                value = float(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({e.problem})") from None
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p} is not a section")
        node[parts[-1]] = value
    return out


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = _deep_merge(merged[k], v)
        else:
            merged[k] = v
    return merged


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            lines.append(f"config error: unknown key {loc!r}")
        elif e["type"] == "literal_error":
            lines.append(f"config error: {loc}={e['input']!r} is not allowed; {msg.lower()}")
        elif loc:
            lines.append(f"config error: {loc}={e['input']!r}: {msg}")
        else:
            lines.append(f"config error: {msg}")
    return "\n".join(lines)


def config_from_dict(data: dict[str, Any]) -> ExperimentConfig:
    """Validate a nested dict. Raises ConfigError with readable lines."""
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None
    except (ValueError, ImportError) as err:  # raised by _check_registry_name's plugin imports
        raise ConfigError(f"config error: {err}") from None


def yaml_error_line(path: str | Path, e: yaml.YAMLError) -> str:
    """One line for a file that is not valid YAML: ``config error: FILE:LINE:COLUMN: not valid
    YAML: PROBLEM`` (1-based, where PyYAML marks the problem; PyYAML's own text spans 8 lines)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    context = getattr(e, "context", None)
    return f"config error: {where}: not valid YAML: {problem}" + (f" ({context})" if context else "")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Load a YAML config (or defaults when ``path`` is None) and apply dotted overrides.

    Raises ConfigError (file missing, not YAML, not a mapping, invalid values).
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config error: file {str(p)!r} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(yaml_error_line(p, e)) from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config error: {p} must hold a mapping at the top level")
        data = loaded or {}
    over = parse_overrides(overrides or [])
    if "pools" in over.get("placement", {}) and "pools" not in data.get("placement", {}):
        # an override of one pool edits the default pools instead of replacing them all
        defaults = {k: v.model_dump() for k, v in _default_pools().items()}
        data = _deep_merge(data, {"placement": {"pools": defaults}})
    data = _deep_merge(data, over)
    return config_from_dict(data)


def flatten_config(cfg: BaseModel, prefix: str = "") -> dict[str, Any]:
    """Flatten to ``{"actor.lr": 1e-6, ...}`` (lists and dicts of scalars as their repr)."""
    out: dict[str, Any] = {}
    for name in type(cfg).model_fields:
        value = getattr(cfg, name)
        key = f"{prefix}{name}"
        if isinstance(value, BaseModel):
            out.update(flatten_config(value, key + "."))
        elif isinstance(value, dict) and value and all(isinstance(v, BaseModel) for v in value.values()):
            for k, v in value.items():
                out.update(flatten_config(v, f"{key}.{k}."))
        else:
            out[key] = value
    return out


def dump_config(cfg: ExperimentConfig) -> str:
    """The fully resolved config as YAML (round-trips through load_config). The run's precision
    decision (``model.resolved_precision``) is run state, not config: it is left out."""
    return yaml.safe_dump(cfg.model_dump(mode="json", exclude={"model": {"resolved_precision"}}), sort_keys=False)
