"""The run folder's Prefect result records are never unpickled: a record naming the pickle
serializer (or any record that is not a JSON node result) is refused in one line naming the
file — by ``hybridflow train --resume`` before any server starts, and by the node cache-key
function before Prefect's ResultStore reads it during a run.

Each planted record carries a payload that creates a marker file when it is deserialized by
Prefect; the control case shows that Prefect's own reader does run it."""

from __future__ import annotations

import base64
import json
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest

from tasks.common import RunContext, node_cache_key, result_storage_path
from tasks.results import ResultRecordError, check_result_record, check_result_records
from tests.unit.test_reliability_inputs import args_for, good_data, no_servers, run_cli  # noqa: F401 - fixtures
from tests.unit.test_reliability_security import _Boom

GOOD_RESULT = {"node": "reward", "ref": None, "metrics": {"timing_s/reward": 0.5}}
JSON_SERIALIZER = {"type": "json", "jsonlib": "json", "object_encoder": "prefect.serializers.prefect_json_object_encoder",
                   "object_decoder": "prefect.serializers.prefect_json_object_decoder", "dumps_kwargs": {},
                   "loads_kwargs": {}}


def _record(serializer: dict, result: str) -> bytes:
    return json.dumps({"metadata": {"storage_key": "k", "expiration": None, "serializer": serializer,
                                    "prefect_version": "3.9.1", "storage_block_id": None}, "result": result}).encode()


def pickle_record(marker: Path) -> bytes:
    payload = base64.b64encode(pickle.dumps(_Boom(str(marker)))).decode()
    return _record({"type": "pickle", "picklelib": "cloudpickle", "picklelib_version": None}, payload)


def json_class_record(marker: Path) -> bytes:
    """Prefect's JSON decoder imports the module of the class a "__class__" key names: here a
    module beside the marker (on sys.path in the test) whose import creates the marker."""
    module = f"planted_{marker.name}"
    (marker.parent / f"{module}.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\nThing = dict\n")
    return _record(JSON_SERIALIZER, json.dumps({"__class__": f"{module}.Thing", "data": {}}))


def good_record() -> bytes:
    return _record(JSON_SERIALIZER, json.dumps(GOOD_RESULT))


def test_only_json_node_results_pass(tmp_path):
    path = tmp_path / "rec"
    path.write_bytes(good_record())
    assert check_result_record(path) == GOOD_RESULT
    cases = {
        "names the 'pickle' serializer": pickle_record(tmp_path / "m"),
        "names a Python class to import": _record(JSON_SERIALIZER, json.dumps({**GOOD_RESULT, "x": {"__class__": "os.system"}})),
        "not Prefect's plain one": _record({**JSON_SERIALIZER, "object_decoder": "os.system"}, json.dumps(GOOD_RESULT)),
        "not a node result": _record(JSON_SERIALIZER, json.dumps([1, 2])),
        "neither null nor a batch reference": _record(JSON_SERIALIZER, json.dumps({**GOOD_RESULT, "ref": {"uri": 1}})),
        "not a JSON record": b"\x80\x04not json",
    }
    for why, data in cases.items():
        path.write_bytes(data)
        with pytest.raises(ResultRecordError, match=f"refusing Prefect result record {path}: .*{why}"):
            check_result_record(path)


def test_resume_refuses_a_pickle_record_before_servers(tmp_path, good_data, capsys, no_servers):  # noqa: F811
    from hybridflow.config import dump_config, load_config

    run = tmp_path / "runs" / "r"
    records = result_storage_path(str(run))
    records.mkdir(parents=True)
    (run / "config.yaml").write_text(dump_config(load_config(None, args_for(tmp_path, good_data)[1:])))
    (run / "run.json").write_text(json.dumps({"run_id": "r"}))
    (records / "r-iter000001-reward-0123456789abcdef").write_bytes(good_record())
    planted = records / "r-iter000001-rollout-0123456789abcdef"
    marker = tmp_path / "pwned"
    planted.write_bytes(pickle_record(marker))
    code, err = run_cli(["train", "--resume", str(run)], capsys)
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"refusing Prefect result record {planted}: it names the 'pickle' serializer" in err
    assert not marker.exists() and planted.exists()  # not executed; left for the user to inspect
    planted.unlink()
    assert check_result_records(run) == 1


def test_the_record_of_a_failed_task_run_does_not_stop_a_resume(tmp_path):
    """Prefect persists a failed task run's exception under a random name (seen in
    test_recovery_and_extending's resumed run C); no cache key names it, so no resume reads it."""
    run = tmp_path / "r"
    records = result_storage_path(str(run))
    records.mkdir(parents=True)
    failed = json.dumps({"__exc_type__": "builtins.RuntimeError", "message": "injected failure"})
    (records / "5e8d1ae0548040edb5e945086d7dfbc0").write_bytes(_record(JSON_SERIALIZER, failed))
    (records / "r-iter000001-reward-0123456789abcdef").write_bytes(good_record())
    assert check_result_records(run) == 1
    (records / "r-iter000002-reward-0123456789abcdef").write_bytes(_record(JSON_SERIALIZER, failed))
    with pytest.raises(ResultRecordError, match="r-iter000002-reward"):  # under a node's key it is refused
        check_result_records(run)


@pytest.mark.parametrize("make", [pickle_record, json_class_record])
def test_a_planted_record_never_reaches_prefects_reader(tmp_path, make, monkeypatch):
    """During a run, Prefect looks a node's result up under its cache key with its ResultStore (the
    task engine's ``store.exists(key)`` deserializes the record). The key function runs first and
    sets a bad record aside, so Prefect finds none and the node runs again."""
    from prefect.filesystems import LocalFileSystem
    from prefect.results import ResultStore

    monkeypatch.syspath_prepend(str(tmp_path))
    run = RunContext("r", str(tmp_path / "r"), 3, "ns", 0, {})
    folder = result_storage_path(run.run_dir)
    folder.mkdir(parents=True)
    store = ResultStore(result_storage=LocalFileSystem(basepath=str(folder)))
    context = SimpleNamespace(task=SimpleNamespace(name="rollout"))
    key = node_cache_key(context, {"run": run, "prompts": {"node": "prompts", "ref": None, "metrics": {}}})
    control = tmp_path / "control"
    (folder / key).write_bytes(make(control))
    store.exists(key)  # the control: Prefect's own reader runs the payload
    assert control.exists()

    marker = tmp_path / "pwned"
    (folder / key).write_bytes(make(marker))
    assert node_cache_key(context, {"run": run, "prompts": {"node": "prompts", "ref": None, "metrics": {}}}) == key
    assert not (folder / key).exists() and [p.name.rsplit("-", 2)[0] for p in folder.iterdir()] == [f"{key}.refused"]
    assert store.exists(key) is False and not marker.exists()
    # a JSON node result under the key is left alone and read as a cache hit
    (folder / key).write_bytes(good_record())
    node_cache_key(context, {"run": run, "prompts": {"node": "prompts", "ref": None, "metrics": {}}})
    assert store.read(key).result == GOOD_RESULT
