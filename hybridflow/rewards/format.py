"""Format reward: does the response put its final answer where the task asked?

Styles (``reward.format_style``), one check per name in a :class:`~hybridflow.registry.Registry`:

- ``boxed``: a closed ``\\boxed{...}`` with non-empty content (math, arith).
- ``answer_tags``: a non-empty ``<answer>...</answer>`` pair (TinyZero countdown).
- ``hash``: a ``#### N`` line with a number (GSM8K's own answer format).

Each check returns 1.0 or 0.0. :func:`~hybridflow.rewards.registry.default_compute_score`
mixes it with correctness: ``score = correctness_weight·correct + format_weight·format``.
"""

from __future__ import annotations

from collections.abc import Callable

from hybridflow.registry import Registry
from hybridflow.rewards.extract import extract_answer_tags, extract_boxed, extract_hash_answer

FORMAT_STYLES: Registry[Callable[[str], bool]] = Registry("format style")
register_format_style = FORMAT_STYLES.register  # a format check ``fn(solution_str) -> bool``; a duplicate name raises


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
    return 1.0 if FORMAT_STYLES.get(style)(solution_str) else 0.0


__all__ = ["format_score", "register_format_style"]
