"""load_rows: verl rows from parquet / jsonl / saved HF datasets, configurable keys, bad rows."""

import json

import datasets  # test extra only: proves compatibility with the real writer; the loader does not need it
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.config import DataConfig
from hybridflow.data import BadRowError, DataFileError, load_rows, write_rows


def _row(i=0, **over):
    row = {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"question {i}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(i)},
        "extra_info": {"split": "train", "index": i},
    }
    row.update(over)
    return row


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_parquet_jsonl_and_saved_hf_dataset_give_the_same_rows(tmp_path):
    rows = [_row(i) for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    _jsonl(tmp_path / "a.jsonl", rows)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    loaded = [load_rows([str(p)], DataConfig()) for p in (tmp_path / "a.parquet", tmp_path / "a.jsonl", tmp_path / "hf")]
    for rs in loaded:
        assert [r.prompt for r in rs] == [r["prompt"] for r in rows]  # lists of dicts, not numpy arrays
        assert [r.ground_truth for r in rs] == ["0", "1", "2"]
        assert [r.extra_info for r in rs] == [r["extra_info"] for r in rows]
        assert rs[1].data_source == "openai/gsm8k" and rs[1].reward_style == "rule" and rs[1].ability == "math"
    assert [r.uid for r in loaded[0]] == ["a-0", "a-1", "a-2"]  # "<file stem>-<row index>"
    assert [r.uid for r in loaded[2]] == ["hf-0", "hf-1", "hf-2"]


def test_dataset_dict_folder_points_at_its_splits(tmp_path):
    datasets.DatasetDict({"train": datasets.Dataset.from_list([_row()])}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataFileError, match="DatasetDict; point at one split folder.*dd/train"):
        load_rows([str(tmp_path / "dd")], DataConfig())
    assert len(load_rows([str(tmp_path / "dd" / "train")], DataConfig())) == 1


def test_several_files_in_order_with_distinct_uids(tmp_path):
    (tmp_path / "x").mkdir()
    a = _jsonl(tmp_path / "train.jsonl", [_row(0), _row(1)])
    b = _jsonl(tmp_path / "x" / "train.jsonl", [_row(2)])  # same stem, other folder
    rs = load_rows([a, b], DataConfig())
    assert [r.uid for r in rs] == ["train-0", "train-1", "train2-0"]
    assert [r.ground_truth for r in rs] == ["0", "1", "2"]


def test_configurable_column_names(tmp_path):
    row = {"src": "arith", "messages": [{"role": "user", "content": "1+1?"}], "rm": {"ground_truth": "2"}, "meta": {"k": 1}}
    cfg = DataConfig(prompt_key="messages", data_source_key="src", reward_model_key="rm", extra_info_key="meta")
    (r,) = load_rows([_jsonl(tmp_path / "c.jsonl", [row])], cfg)
    assert (r.data_source, r.ground_truth, r.extra_info, r.reward_style) == ("arith", "2", {"k": 1}, None)


BAD_ROWS = [
    (_row(prompt=None), "field 'prompt': missing"),
    (_row(prompt=[]), "field 'prompt': is empty"),
    (_row(prompt=[{"role": "user", "content": "   "}]), "every message has empty content"),
    (_row(prompt=[{"role": "user", "content": 3}]), r"field 'prompt\[0\].content': expected a string, got int"),
    (_row(prompt=["hi"]), r"field 'prompt\[0\]': expected a message"),
    (_row(prompt="a plain string"), "is a string, but data.apply_chat_template=true"),
    (_row(reward_model={"style": "rule"}), "field 'reward_model.ground_truth': missing, and the reward needs it"),
    (_row(reward_model=None), "'reward_model.ground_truth': missing"),
    (_row(reward_model={"ground_truth": 42}), "ground_truth': expected a string .*got int '42'"),  # not coerced
    (_row(reward_model="72"), "field 'reward_model': expected an object"),
    (_row(data_source=""), "field 'data_source'"),
    (_row(extra_info=[1, 2]), "field 'extra_info': expected an object, got list"),
    (_row(ability=5), "field 'ability'"),
]


@pytest.mark.parametrize("bad, message", BAD_ROWS)
def test_bad_row_error_names_file_row_and_field(tmp_path, bad, message):
    path = _jsonl(tmp_path / "d.jsonl", [_row(0), bad])
    with pytest.raises(BadRowError, match=message) as err:
        load_rows([path], DataConfig())
    assert str(err.value).startswith(f"{path}: row 1: field ")


def test_bad_rows_skipped_and_counted(tmp_path):
    rows = [_row(0), BAD_ROWS[0][0], _row(2), BAD_ROWS[8][0], _row(4)]
    rs = load_rows([_jsonl(tmp_path / "d.jsonl", rows)], DataConfig(on_bad_row="skip"))
    assert [r.uid for r in rs] == ["d-0", "d-2", "d-4"]  # uids keep the file's row index
    assert rs.skipped == 2
    assert "row 1: field 'prompt'" in rs.skip_reasons[0] and "row 3: field 'reward_model.ground_truth'" in rs.skip_reasons[1]


def test_ground_truth_optional_when_the_reward_needs_none(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [_row(reward_model=None)])
    (r,) = load_rows([path], DataConfig(), require_ground_truth=False)
    assert r.ground_truth is None


def test_structured_ground_truth_as_tinyzero_writes_it(tmp_path):
    row = _row(data_source="countdown", reward_model={"style": "rule", "ground_truth": {"target": 5, "numbers": [2, 3]}})
    (r,) = load_rows([_jsonl(tmp_path / "t.jsonl", [row])], DataConfig())
    assert r.ground_truth == {"target": 5, "numbers": [2, 3]}


def test_string_prompts_without_chat_template(tmp_path):
    cfg = DataConfig(apply_chat_template=False)
    (r,) = load_rows([_jsonl(tmp_path / "s.jsonl", [_row(prompt="Q: 1+1=")])], cfg)
    assert r.prompt == "Q: 1+1="
    with pytest.raises(BadRowError, match="is a list of messages, but data.apply_chat_template=false"):
        load_rows([_jsonl(tmp_path / "l.jsonl", [_row()])], cfg)


def test_file_errors(tmp_path):
    with pytest.raises(DataFileError, match="does not exist"):
        load_rows([str(tmp_path / "nope.parquet")], DataConfig())
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataFileError, match="unknown format"):
        load_rows([str(tmp_path / "x.csv")], DataConfig())
    (tmp_path / "broken.jsonl").write_text(json.dumps(_row()) + "\n{not json\n")
    with pytest.raises(DataFileError, match="broken.jsonl: line 2 is not valid JSON"):
        load_rows([str(tmp_path / "broken.jsonl")], DataConfig())
    with pytest.raises(ValueError, match="no data files"):
        load_rows([], DataConfig())


def test_write_rows_round_trip(tmp_path):
    rows = [_row(i) for i in range(2)]
    for name in ("out/r.parquet", "out/r.jsonl"):
        write_rows(rows, str(tmp_path / name))
        assert [r.ground_truth for r in load_rows([str(tmp_path / name)], DataConfig())] == ["0", "1"]
    with pytest.raises(DataFileError, match="use a .parquet or .jsonl name"):
        write_rows(rows, str(tmp_path / "r.csv"))


def test_a_row_that_is_not_utf8_is_named_by_its_line_and_can_be_skipped(tmp_path):
    """Issue 40, defect 12: non-UTF-8 bytes in one jsonl row: the error names the line (not a byte
    offset into the file), and data.on_bad_row=skip drops that row and keeps the others."""
    path = tmp_path / "latin1.jsonl"
    good = [json.dumps(_row(i)).encode() for i in range(3)]
    bad = json.dumps(_row(9)).encode().replace(b'"9"', b'"caf\xe9"')
    path.write_bytes(b"\n".join([good[0], good[1], bad, good[2]]) + b"\n")
    column = bad.index(b"\xe9") + 1
    with pytest.raises(BadRowError) as err:
        load_rows([str(path)], DataConfig())
    assert str(err.value) == (f"{path}: line 3 is not UTF-8 text (byte 0xe9 at column {column}) "
                              "(set data.on_bad_row=skip to drop such rows)")
    rows = load_rows([str(path)], DataConfig(on_bad_row="skip"))
    assert [r.ground_truth for r in rows] == ["0", "1", "2"] and rows.skipped == 1
