"""Read and write verl-format row files: parquet, jsonl, and Hugging Face ``save_to_disk`` dirs.

Readers return plain Python records (``list[dict]``): parquet through pyarrow's
``to_pylist`` (nested lists and structs stay lists and dicts, never numpy arrays), jsonl one
JSON object per line, and a saved ``datasets.Dataset`` folder by reading its Arrow files
directly (``state.json`` lists them), so the ``datasets`` package is not needed. Paths may be
fsspec URIs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec


class DataFileError(ValueError):
    """A data file cannot be read (missing, unknown format, malformed line)."""


def read_records(path: str) -> list[Any]:
    """All records of one file or saved-dataset folder, in file order.

    Raises DataFileError naming the path (and the line, for invalid jsonl).
    """
    fs, fpath = fsspec.core.url_to_fs(path)
    if not fs.exists(fpath):
        raise DataFileError(f"data file {path!r} does not exist")
    if fs.isdir(fpath):
        return _read_saved_dataset(fs, fpath, path)
    if fpath.endswith(".parquet"):
        import pyarrow.parquet as pq

        with fs.open(fpath, "rb") as f:
            return pq.read_table(f).to_pylist()
    if fpath.endswith((".jsonl", ".json")):
        return _read_jsonl(fs, fpath, path)
    raise DataFileError(f"data file {path!r}: unknown format; use .parquet, .jsonl or a saved HF dataset folder")


@dataclass(frozen=True)
class UnreadableLine:
    """A jsonl line that is not UTF-8 text, in place of its record: the row is bad (an error
    naming ``line``, or dropped with ``data.on_bad_row=skip``), the rest of the file is read."""

    line: int  # 1-based line number in the file
    problem: str


def _read_jsonl(fs: Any, fpath: str, path: str) -> list[Any]:
    records: list[Any] = []
    with fs.open(fpath, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                records.append(UnreadableLine(lineno, f"line {lineno} is not UTF-8 text "
                                                      f"(byte 0x{raw[e.start]:02x} at column {e.start + 1})"))
                continue
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataFileError(f"{path}: line {lineno} is not valid JSON ({e.msg})") from None
    return records


def _read_saved_dataset(fs: Any, fpath: str, path: str) -> list[Any]:
    import pyarrow as pa

    if fs.exists(f"{fpath}/dataset_dict.json"):
        splits = json.loads(fs.cat_file(f"{fpath}/dataset_dict.json"))["splits"]
        raise DataFileError(f"{path} is a DatasetDict; point at one split folder: {[f'{path}/{s}' for s in splits]}")
    if not fs.exists(f"{fpath}/state.json"):
        raise DataFileError(f"{path} is a folder without state.json: not a datasets.save_to_disk folder")
    state = json.loads(fs.cat_file(f"{fpath}/state.json"))
    records: list[Any] = []
    for entry in state["_data_files"]:
        with fs.open(f"{fpath}/{entry['filename']}", "rb") as f:
            data = f.read()
        try:
            table = pa.ipc.open_stream(data).read_all()
        except pa.ArrowInvalid:
            table = pa.ipc.open_file(data).read_all()
        records.extend(table.to_pylist())
    return records


def write_rows(rows: list[dict[str, Any]], path: str) -> None:
    """Write verl-format rows to ``.parquet`` or ``.jsonl`` (by suffix; parents created)."""
    fs, fpath = fsspec.core.url_to_fs(path)
    parent = str(Path(fpath).parent)
    if parent not in ("", "."):
        fs.makedirs(parent, exist_ok=True)
    if fpath.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        with fs.open(fpath, "wb") as f:
            pq.write_table(pa.Table.from_pylist(rows), f)
    elif fpath.endswith(".jsonl"):
        with fs.open(fpath, "wt", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    else:
        raise DataFileError(f"cannot write {path!r}: use a .parquet or .jsonl name")


__all__ = ["read_records", "write_rows", "DataFileError", "UnreadableLine"]
