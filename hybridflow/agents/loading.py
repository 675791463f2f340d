"""Import a user object from a spec: ``"package.module:name"`` or ``"path/to/file.py:name"``.

The same spec forms as ``reward.function`` (:mod:`hybridflow.rewards.loader`), imported by the
same :func:`hybridflow.user_code.import_user_module`: a file is imported once per process under
a name derived from its resolved path, so objects defined in it pickle and unpickle in any
process that loaded the same spec.
"""

from __future__ import annotations

from typing import Any

from hybridflow.user_code import import_user_module


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
    module = import_user_module(
        where, label=f"{key}={spec!r}", prefix="hybridflow_user_agent_", error_cls=AgentLoadError, keep_cause=False
    )
    if not hasattr(module, name):
        raise AgentLoadError(f"{key}={spec!r}: {where} has no attribute {name!r}")
    return getattr(module, name)
