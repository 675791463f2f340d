"""The run folder's Prefect result records are read as JSON of one known shape, never unpickled.

A node's cached result lives in ``<run_dir>/prefect-results/<cache key>`` as a Prefect result
record::

    {"metadata": {"serializer": {"type": "hybridflow-node-result"}, "storage_key": ..., ...},
     "result": "{\"kind\": \"node\", \"node\": \"reward\", \"ref\": {...BatchRef...} | null, \"metrics\": {...}}"}

Prefect deserializes a record with the serializer *the file names* (``pickle`` runs code; its
JSON serializer imports any class a ``"__class__"`` key names), and it does so even to check
that a cached result exists. So hybridflow reads each record first, with plain ``json.loads``,
and accepts only: hybridflow's node-result serializer (:class:`tasks.types.NodeResultSerializer`,
which builds one of three known types and imports nothing), or — records written before it —
the JSON serializer with Prefect's own decoder and no extra options; and a result that is a node
result (``node``: str, ``ref``: a BatchRef dict or null, ``metrics``: name → number, and the
fields of its ``kind``) with no ``__class__`` / ``__exc_type__`` key anywhere. Anything else is a
:class:`ResultRecordError` naming the file:

- :func:`check_result_records` — every node record, when a run is resumed (before any server starts);
- :func:`guard_cached_record` — the record a node is about to look up, from its cache-key
  function (``tasks.common.node_cache_key``), i.e. before Prefect reads it: a bad record is set
  aside as ``<key>.refused`` with one warning line and the node runs again.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from hybridflow.layout import RESULTS

SERIALIZER_TYPE = "hybridflow-node-result"  # tasks.serializer.NodeResultSerializer
REFUSED_SUFFIX = ".refused"
_SERIALIZER = {"type": "json", "jsonlib": "json",
               "object_encoder": "prefect.serializers.prefect_json_object_encoder",
               "object_decoder": "prefect.serializers.prefect_json_object_decoder",
               "dumps_kwargs": {}, "loads_kwargs": {}}
_METADATA_KEYS = {"storage_key", "expiration", "serializer", "prefect_version", "storage_block_id"}
_REF_FIELDS = {"run_id": str, "iteration": int, "node": str, "uri": str, "rows": int, "keys": list, "checksum": str}
_CODE_KEYS = ("__class__", "__exc_type__")  # what Prefect's JSON decoder turns into imports
# fields a result kind adds to (node, ref, metrics), with their JSON types (tasks.types)
_KIND_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "node": {}, "advantage": {"kl_coef_next": (int, float, type(None))}, "update": {"applied": (bool,), "version": (int,)},
    "rollout": {"rollout_version": (int,), "started_at": (int, float), "finished_at": (int, float),
                "groups": (list,), "dropped": (list,), "started": (list,)},
    "reward": {"failed_rows": (int,), "last_error": (str, type(None))},
}


class ResultRecordError(ValueError):
    """A Prefect result record in a run folder is not a JSON node result (names the file)."""


def _refuse(path: Path, why: str) -> ResultRecordError:
    return ResultRecordError(f"refusing Prefect result record {path}: {why}; it is never loaded "
                             "(delete it to let that node run again)")


def _no_code_keys(value: Any) -> bool:
    if isinstance(value, dict):
        return not any(k in value for k in _CODE_KEYS) and all(_no_code_keys(v) for v in value.values())
    if isinstance(value, list):
        return all(_no_code_keys(v) for v in value)
    return True


def _shape_problem(result: Any) -> str | None:
    if not isinstance(result, dict) or not isinstance(result.get("node"), str):
        return "the result is not a node result ({'node': str, 'ref': ..., 'metrics': ...})"
    metrics = result.get("metrics")
    if not isinstance(metrics, dict) or not all(
            isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) for k, v in metrics.items()):
        return "its 'metrics' is not a mapping of names to numbers"
    ref = result.get("ref", "missing")
    if ref is not None and not (isinstance(ref, dict) and set(ref) == set(_REF_FIELDS)
                                and all(isinstance(ref[k], t) for k, t in _REF_FIELDS.items())
                                and all(isinstance(k, str) for k in ref["keys"])):
        return "its 'ref' is neither null nor a batch reference"
    if not _no_code_keys(result):
        return "the result names a Python class to import ('__class__' / '__exc_type__')"
    return _kind_problem(result)


def _kind_problem(result: dict[str, Any]) -> str | None:
    kind = result.get("kind", "node")
    extra = _KIND_FIELDS.get(kind) if isinstance(kind, str) else None
    if extra is None:
        return f"its kind {kind!r} is not a node result kind ({', '.join(_KIND_FIELDS)})"
    unknown = set(result) - {"kind", "node", "ref", "metrics"} - set(extra)
    if unknown:
        return f"it has fields no {kind} result has: {sorted(unknown)}"
    bad = [k for k, types in extra.items() if k in result and (not isinstance(result[k], types)
           or (bool not in types and isinstance(result[k], bool)))]
    return f"its field(s) {bad} have the wrong type" if bad else None


def check_result_record(path: str | os.PathLike) -> dict[str, Any]:
    """The node result stored in the record at ``path``, read with plain ``json.loads``.
    Raises ResultRecordError (naming the file and what is wrong) for anything else."""
    path = Path(path)
    try:
        record = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise _refuse(path, f"not a JSON record ({type(e).__name__})") from None
    if not isinstance(record, dict) or set(record) != {"metadata", "result"} or not isinstance(record["metadata"], dict):
        raise _refuse(path, "not a Prefect result record of the expected shape")
    meta = record["metadata"]
    serializer = meta.get("serializer")
    kind = serializer.get("type") if isinstance(serializer, dict) else None
    if kind not in ("json", SERIALIZER_TYPE):
        raise _refuse(path, f"it names the {kind!r} serializer; only JSON is accepted")
    if kind == SERIALIZER_TYPE and serializer != {"type": SERIALIZER_TYPE}:
        raise _refuse(path, "its node-result serializer has options")
    if kind == "json" and serializer != {**_SERIALIZER, **{k: serializer[k] for k in ("object_encoder", "dumps_kwargs") if k in serializer}}:
        raise _refuse(path, "its JSON serializer is not Prefect's plain one (custom jsonlib, decoder or options)")
    if not set(meta) <= _METADATA_KEYS or not isinstance(record["result"], str):
        raise _refuse(path, "unexpected metadata fields or a non-text result")
    try:
        result = json.loads(record["result"])
    except ValueError:
        raise _refuse(path, "its result is not JSON") from None
    problem = _shape_problem(result)
    if problem:
        raise _refuse(path, problem)
    return result


# the names :func:`tasks.common.node_cache_key` gives: ``<run_id>-iter<000007>-<node>-<16 hex>``
NODE_RECORD_NAME = re.compile(r".+-iter\d{6}-.+-[0-9a-f]{16}")


def check_result_records(run_dir: str | os.PathLike) -> int:
    """Check every node record under ``<run_dir>/prefect-results`` — the files named like a node
    cache key, the only ones a resumed run looks up. Prefect also persists the records of task runs
    that *failed* (``{"__exc_type__": ...}`` under a random name); no cache key points at them, so
    nothing of hybridflow's or Prefect's reads them on a resume, and they are left alone, as are
    set-aside ``*.refused`` files. Returns how many were checked; raises ResultRecordError."""
    folder = Path(run_dir) / RESULTS
    if not folder.is_dir():
        return 0
    records = sorted(p for p in folder.rglob("*")
                     if p.is_file() and REFUSED_SUFFIX not in p.name and NODE_RECORD_NAME.fullmatch(p.name))
    for path in records:
        check_result_record(path)
    return len(records)


def guard_cached_record(path: str | os.PathLike) -> None:
    """Before Prefect looks up the record at ``path``: if it exists and is not a JSON node
    result, move it aside (``<name>.refused-<time>``) and log one warning line naming it, so
    Prefect finds no record and the node runs again. Raises ResultRecordError only when it cannot
    be moved (from the cache-key function, that makes Prefect run the node without its cache)."""
    path = Path(path)
    if not path.is_file():
        return
    try:
        check_result_record(path)
        return
    except ResultRecordError as e:
        message = str(e)
    aside = path.with_name(f"{path.name}{REFUSED_SUFFIX}-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        os.replace(path, aside)
    except OSError as err:  # raising from the cache-key function makes Prefect skip the cache entirely
        raise ResultRecordError(f"{message}; could not move it aside ({err.strerror})") from None
    message += f"; moved to {aside.name}, the node runs again"
    try:
        from prefect import get_run_logger

        get_run_logger().warning(message)
    except Exception:  # noqa: BLE001 - outside a task run
        import sys

        print(message, file=sys.stderr)


__all__ = ["ResultRecordError", "check_result_record", "check_result_records", "guard_cached_record"]
