"""The pool's error type and how a Ray failure is shortened to the one line it reports."""

from __future__ import annotations


class PoolError(RuntimeError):
    """A pool cannot serve: names the pool, the rank and the cause."""


class RankTimeout(PoolError):
    """A rank did not answer a call within its timeout: ``pool`` (name), ``rank``, ``method``
    (``role.method``), ``timeout_s``. The rank may be hung; the caller decides whether to restart it."""

    def __init__(self, pool: str, rank: int, method: str, timeout_s: float | None):
        super().__init__(f"pool {pool!r} rank {rank}: {method} timed out after {timeout_s}s")
        self.pool, self.rank, self.method, self.timeout_s = pool, rank, method, timeout_s


def cause(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def root_cause(e: BaseException) -> str:
    """The innermost error line of a Ray actor failure (e.g. 'FileNotFoundError: model path ...')."""
    text = str(e)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln.split(":")[0]:
            return ln
    return lines[-1] if lines else type(e).__name__
