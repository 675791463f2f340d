"""A run stopped by a full disk ends in one line naming the file and what to do (flows/console.py
storage_error_line), however the error travelled: raised again while the stop reason was being
written (its ``__context__``), or wrapped by Ray (``.cause``). Found by the chaos soak's enospc
fault: the driver ended in a long traceback."""

from __future__ import annotations

import errno

from flows.console import storage_error_line

FULL = OSError(errno.ENOSPC, "No space left on device", "/runs/r/metrics.jsonl")
LINE = ("error: No space left on device writing /runs/r/metrics.jsonl: free space, then continue the run "
        "with hybridflow train --resume <run dir> (nothing completed is lost)")


def _raised_while_handling(first: BaseException, second: BaseException) -> BaseException:
    try:
        try:
            raise first
        except BaseException:
            raise second  # noqa: B904 - the implicit context is the point
    except BaseException as e:  # noqa: BLE001
        return e


def test_a_full_disk_is_one_line_naming_the_file():
    assert storage_error_line(FULL) == LINE
    quota = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert storage_error_line(quota).startswith("error: Disk quota exceeded: free space")


def test_found_behind_a_second_failure_and_behind_rays_wrapper():
    second = OSError(errno.ENOSPC, "No space left on device", "/runs/r/run.json")
    assert "writing /runs/r/run.json" in storage_error_line(_raised_while_handling(FULL, second))
    assert storage_error_line(_raised_while_handling(FULL, RuntimeError("summary failed"))) == LINE

    class RayTaskError(Exception):
        def __init__(self, cause):
            super().__init__("wrapped")
            self.cause = cause

    assert storage_error_line(RayTaskError(FULL)) == LINE


def test_other_errors_are_not_storage_errors():
    assert storage_error_line(OSError(errno.EACCES, "Permission denied", "/x")) is None
    assert storage_error_line(ValueError("bad")) is None
