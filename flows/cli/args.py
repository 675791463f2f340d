"""The one override parser of every subcommand: dotted ``key.path=value`` config overrides.

argparse fills a trailing ``overrides`` positional (nargs="*") together with the positional
before it, so in ``config show -c FILE actor.lr=3e-6`` the override after ``-c FILE`` would be
"unrecognized", and a ``--data a.parquet b.parquet`` list swallows the overrides that follow it.
:class:`OverridesAnywhere` (the parser class of every subcommand) takes the overrides wherever
they stand: leftovers are appended to ``overrides``, and override-shaped items of the list
options named in ``OVERRIDE_SWALLOWERS`` are moved back out of them.
"""

from __future__ import annotations

import argparse
import re

_OVERRIDE = re.compile(r"^[A-Za-z_]\w*(\.\w+)+=")
# nargs="+" options whose lists may swallow overrides (``hybridflow eval --data FILE ... key=value``)
OVERRIDE_SWALLOWERS = ("data",)


def is_override(arg: str) -> bool:
    """True for ``section.key=value`` (at least one dot before the ``=``)."""
    return bool(_OVERRIDE.match(arg))


def add_overrides(p: argparse.ArgumentParser, example: str = "actor.lr=2e-6") -> None:
    """The ``key=value ...`` positional of a subcommand."""
    p.add_argument("overrides", nargs="*", help=f"dotted config overrides, e.g. {example}")


class OverridesAnywhere(argparse.ArgumentParser):
    """A subcommand parser that takes ``key.path=value`` overrides wherever they stand."""

    def parse_known_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201 - argparse's signature
        ns, extras = super().parse_known_args(args, namespace)
        if hasattr(ns, "overrides"):
            moved = []
            for name in OVERRIDE_SWALLOWERS:
                values = getattr(ns, name, None)
                if isinstance(values, list):
                    setattr(ns, name, [v for v in values if not is_override(v)])
                    moved += [v for v in values if is_override(v)]
            ns.overrides = moved + list(ns.overrides or []) + [a for a in extras if is_override(a)]
            extras = [a for a in extras if not is_override(a)]
        return ns, extras
