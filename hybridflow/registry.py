"""``Registry(kind)``: name → implementation, one implementation per name.

Every pluggable thing (advantage estimators, policy losses, rule rewards, format styles, tool
formats, environments, dispatch protocols, rollout engines) is one of these::

    ADV_ESTIMATORS = Registry("advantage estimator")
    register_advantage_estimator = ADV_ESTIMATORS.register   # the public decorator

    @register_advantage_estimator("grpo")
    def grpo(...): ...

    ADV_ESTIMATORS.get("grpo")      # unknown name: UnknownNameError listing the known ones
    ADV_ESTIMATORS.names()          # sorted

Registering a taken name raises :class:`DuplicateNameError` naming the module that registered it
first. :class:`UnknownNameError` is both a KeyError and a ValueError (callers written against
either keep working) and prints its message unquoted. (Pattern: verl ``core_algos.py``.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class DuplicateNameError(ValueError):
    """A name is registered twice: ``"<kind> 'x' is already registered (by <module>)"``."""


class UnknownNameError(KeyError, ValueError):
    """No implementation is registered under a name: ``"unknown <kind> 'x'; known: a, b"``."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class Registry(Generic[T]):
    """Name → implementation for one ``kind`` (a noun for messages: "policy loss").

    ``builtins``: called once before the first lookup (:meth:`get`, :meth:`names`, ``in``), e.g.
    to import the modules that register the built-in implementations."""

    def __init__(self, kind: str, *, builtins: Callable[[], None] | None = None):
        self.kind = kind
        self._items: dict[str, T] = {}
        self._owners: dict[str, str] = {}  # name -> module that registered it
        self._builtins = builtins

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={sorted(self._items)})"

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering the decorated object as ``name``; returns it unchanged.
        Raises DuplicateNameError (when applied) if ``name`` is taken."""

        def deco(obj: T) -> T:
            return self.add(name, obj)

        return deco

    def add(self, name: str, obj: T, *, module: str | None = None) -> T:
        """Register ``obj`` as ``name`` and return it. ``module``: who registers it, for the duplicate
        message (default: ``obj.__module__``). Raises DuplicateNameError if ``name`` is taken."""
        self.check_free(name)
        self._items[name] = obj
        self._owners[name] = module or getattr(obj, "__module__", None) or "?"
        return obj

    def check_free(self, name: str) -> None:
        """Raise DuplicateNameError if ``name`` is registered (for registrations of several names
        that must all be free before any is recorded)."""
        if name in self._items:
            raise DuplicateNameError(f"{self.kind} {name!r} is already registered (by {self._owners[name]})")

    def get(self, name: str) -> T:
        """The implementation registered as ``name``. Raises UnknownNameError listing the known names."""
        self._load_builtins()
        try:
            return self._items[name]
        except (KeyError, TypeError):  # TypeError: an unhashable name
            raise UnknownNameError(self.unknown_message(name)) from None

    def unknown_message(self, name: object) -> str:
        """``"unknown <kind> 'x'; known: a, b"`` (for callers that raise their own error type)."""
        return f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}"

    def names(self) -> list[str]:
        """The registered names, sorted."""
        self._load_builtins()
        return sorted(self._items)

    def owner(self, name: str) -> str:
        """The module that registered ``name``. Raises UnknownNameError."""
        self.get(name)
        return self._owners[name]

    def __contains__(self, name: object) -> bool:
        self._load_builtins()
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        self._load_builtins()
        return len(self._items)

    def _load_builtins(self) -> None:
        if self._builtins is not None:
            load, self._builtins = self._builtins, None  # once, and not again while it runs
            load()


__all__ = ["Registry", "DuplicateNameError", "UnknownNameError"]
