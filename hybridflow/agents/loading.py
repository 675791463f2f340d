"""Import a user object from a spec: ``"package.module:name"`` or ``"path/to/file.py:name"``.

The same spec forms as ``reward.function`` (:mod:`hybridflow.rewards.loader`); a file is
imported once per process under a name derived from its resolved path, so objects defined in
it pickle and unpickle in any process that loaded the same spec.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


class AgentLoadError(ImportError):
    """A tool or environment spec could not be loaded (one line, naming the config key)."""


def is_spec(text: str) -> bool:
    """True for 'module:name' / 'file.py:name' forms (a registered name has no colon)."""
    return ":" in text


def load_object(spec: str, key: str) -> Any:
    """The object ``spec`` names. Raises AgentLoadError naming ``key`` (e.g. 'rollout.tools[0]')."""
    if not is_spec(spec):
        raise AgentLoadError(f"{key}={spec!r}: expected 'package.module:name' or 'path/file.py:name'")
    where, name = spec.rsplit(":", 1)
    module = _import_file(spec, where, key) if where.endswith(".py") or "/" in where else _import_module(spec, where, key)
    if not hasattr(module, name):
        raise AgentLoadError(f"{key}={spec!r}: {where} has no attribute {name!r}")
    return getattr(module, name)


def _import_module(spec: str, module_name: str, key: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except BaseException as e:  # noqa: BLE001 - user code may raise anything at import
        raise AgentLoadError(f"{key}={spec!r}: importing {module_name} failed: {type(e).__name__}: {e}") from None


def _import_file(spec: str, path_str: str, key: str) -> Any:
    path = Path(path_str).expanduser().resolve()
    if not path.is_file():
        raise AgentLoadError(f"{key}={spec!r}: file {path_str!r} does not exist")
    mod_name = f"hybridflow_user_agent_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    mspec = importlib.util.spec_from_file_location(mod_name, path)
    if mspec is None or mspec.loader is None:
        raise AgentLoadError(f"{key}={spec!r}: {path} is not a loadable Python file")
    module = importlib.util.module_from_spec(mspec)
    sys.modules[mod_name] = module
    try:
        mspec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001
        del sys.modules[mod_name]
        raise AgentLoadError(f"{key}={spec!r}: importing {path} failed: {type(e).__name__}: {e}") from None
    return module
