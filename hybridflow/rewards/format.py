"""Format reward: does the response put its final answer where the task asked?

Styles (``reward.format_style``), one check per name in a small registry:

- ``boxed``: a closed ``\\boxed{...}`` with non-empty content (math, arith).
- ``answer_tags``: a non-empty ``<answer>...</answer>`` pair (TinyZero countdown).
- ``hash``: a ``#### N`` line with a number (GSM8K's own answer format).

Each check returns 1.0 or 0.0. :func:`~hybridflow.rewards.registry.default_compute_score`
mixes it with correctness: ``score = correctness_weight·correct + format_weight·format``.
"""

from __future__ import annotations

from collections.abc import Callable

from hybridflow.rewards.extract import extract_answer_tags, extract_boxed, extract_hash_answer

_STYLES: dict[str, Callable[[str], bool]] = {}


def register_format_style(name: str) -> Callable[[Callable[[str], bool]], Callable[[str], bool]]:
    """Register a format check ``fn(solution_str) -> bool``; a duplicate name raises ValueError."""

    def deco(fn: Callable[[str], bool]) -> Callable[[str], bool]:
        if name in _STYLES:
            raise ValueError(f"format style {name!r} is already registered")
        _STYLES[name] = fn
        return fn

    return deco


@register_format_style("boxed")
def _boxed(text: str) -> bool:
    content = extract_boxed(text)
    return content is not None and content.strip() != ""


@register_format_style("answer_tags")
def _answer_tags(text: str) -> bool:
    content = extract_answer_tags(text)
    return content is not None and content != ""


@register_format_style("hash")
def _hash(text: str) -> bool:
    return extract_hash_answer(text) is not None


def format_score(solution_str: str, style: str) -> float:
    """1.0 when ``solution_str`` follows ``style``, else 0.0. Unknown style: ValueError listing known ones."""
    try:
        check = _STYLES[style]
    except KeyError:
        raise ValueError(f"unknown format style {style!r}; known: {', '.join(sorted(_STYLES))}") from None
    return 1.0 if check(solution_str) else 0.0


__all__ = ["format_score", "register_format_style"]
