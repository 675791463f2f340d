"""Deprecated names: one warning text, one removal version.

A deprecated name still works until :data:`REMOVAL_VERSION` and warns with a ``FutureWarning``
(shown by default, unlike ``DeprecationWarning``, so plugin authors see it in a plain run) that
names the replacement and the version that removes it. See docs/extending.md, "Migrating".
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

REMOVAL_VERSION = "0.3.0"


def deprecation_message(old: str, new: str) -> str:
    """``"<old> is deprecated and will be removed in hybridflow 0.3.0; use <new>"``."""
    return f"{old} is deprecated and will be removed in hybridflow {REMOVAL_VERSION}; use {new}"


def warn_deprecated(old: str, new: str, *, stacklevel: int = 2) -> None:
    """Issue the FutureWarning for ``old``. ``stacklevel`` as for :func:`warnings.warn`, counted from
    the caller of this function (2 = the caller's caller, the user code that used ``old``)."""
    warnings.warn(deprecation_message(old, new), FutureWarning, stacklevel=stacklevel + 1)


def deprecated_attributes(module: str, aliases: dict[str, tuple[str, Callable[[], Any]]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving deprecated module attributes with a warning.

    ``aliases``: {old name: (replacement as users should spell it, a function returning the value)}.
    Any other name raises AttributeError as a module without ``__getattr__`` would."""

    def __getattr__(name: str) -> Any:
        if name not in aliases:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new, value = aliases[name]
        warn_deprecated(f"{module}.{name}", new)
        return value()

    return __getattr__


__all__ = ["REMOVAL_VERSION", "deprecation_message", "warn_deprecated", "deprecated_attributes"]
