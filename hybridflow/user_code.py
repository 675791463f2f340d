"""Import the module a user spec names: ``"package.module:name"`` or ``"path/to/file.py:name"``.

Shared by ``reward.function`` (:mod:`hybridflow.rewards.loader`) and the agents' tools and
environments (:mod:`hybridflow.agents.loading`); each caller keeps its own error class and
message head. A file is imported once per process under a name derived from its resolved path
(``<prefix><sha1[:12]>``), so objects defined in it pickle and unpickle in any process that
loaded the same spec.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any


def is_file_spec(where: str) -> bool:
    """True when the part before ``:`` is a file path (ends in .py or contains a /)."""
    return where.endswith(".py") or "/" in where


def import_user_module(
    where: str, *, label: str, prefix: str, error_cls: type[Exception], keep_cause: bool = True
) -> ModuleType:
    """The module ``where`` names (a dotted module or a .py file path).

    label: the message head, e.g. ``"reward.function 'f.py:score'"``; prefix: the sys.modules
    name prefix of file imports (``"hybridflow_user_reward_"``). Raises ``error_cls`` with
    ``"{label}: ..."`` for a missing or unloadable file or any exception raised while importing
    (its type and message quoted); keep_cause=False drops the original from the chain.
    """
    cause = (lambda e: e) if keep_cause else (lambda e: None)
    if is_file_spec(where):
        return _import_file(where, label, prefix, error_cls, cause)
    try:
        return importlib.import_module(where)
    except BaseException as e:  # noqa: BLE001 - user code may raise anything at import, even SystemExit
        raise error_cls(f"{label}: importing {where} failed: {type(e).__name__}: {e}") from cause(e)


def _import_file(
    path_str: str, label: str, prefix: str, error_cls: type[Exception], cause: Callable[[BaseException], Any]
) -> ModuleType:
    path = Path(path_str).expanduser().resolve()
    if not path.is_file():
        raise error_cls(f"{label}: file {path_str!r} does not exist")
    mod_name = f"{prefix}{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    mspec = importlib.util.spec_from_file_location(mod_name, path)
    if mspec is None or mspec.loader is None:
        raise error_cls(f"{label}: {path} is not a loadable Python file")
    module = importlib.util.module_from_spec(mspec)
    sys.modules[mod_name] = module
    try:
        mspec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001
        del sys.modules[mod_name]
        raise error_cls(f"{label}: importing {path} failed: {type(e).__name__}: {e}") from cause(e)
    return module


__all__ = ["import_user_module", "is_file_spec"]
