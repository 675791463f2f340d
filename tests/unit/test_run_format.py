"""A run folder written by another hybridflow (issue 40): run.json records the run format and the
hybridflow version that started the run; ``--resume`` reads formats 1..RUN_FORMAT (a folder from
before the format was recorded is format 1, and gets it recorded) and refuses any other in one
line naming the folder, the version that wrote it and ours, rc 2, before any server starts."""

from __future__ import annotations

import json

import pytest

from flows.preflight_base import PreflightError
from flows.run_state import open_run
from hybridflow import __version__
from hybridflow.layout import RUN_FORMAT
from tests.unit.test_reliability_inputs import good_data, no_servers, run_cli  # noqa: F401 - fixtures
from tests.unit.test_reliability_refusals import saved_run  # noqa: F401 - fixture
from tests.unit.test_run_session import cfg  # noqa: F401 - fixture


def test_a_new_run_records_its_format_and_version(cfg):  # noqa: F811
    state = open_run(cfg, resume=None)
    state.close()
    info = json.loads(open(state.dir.run_info_file).read())
    assert info["run_format"] == RUN_FORMAT == 1 and info["hybridflow_version"] == __version__


@pytest.mark.parametrize("recorded", [{"run_format": RUN_FORMAT + 1, "hybridflow_version": "9.9.0"},
                                      {"run_format": "two"}, {"run_format": 0}])  # fmt: skip
def test_a_folder_in_a_format_we_do_not_read_is_refused_in_one_line(saved_run, capsys, no_servers, recorded):  # noqa: F811
    info = {**json.loads((saved_run / "run.json").read_text()), **recorded}
    (saved_run / "run.json").write_text(json.dumps(info))
    code, err = run_cli(["train", "--resume", str(saved_run)], capsys)
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    wrote = recorded.get("hybridflow_version", "an unknown version")
    assert str(saved_run) in err and f"written by hybridflow {wrote} in run format {recorded['run_format']!r}" in err
    assert f"this hybridflow {__version__} reads run formats 1 to {RUN_FORMAT}" in err
    assert json.loads((saved_run / "run.json").read_text()) == info  # nothing written


def test_a_folder_from_before_the_format_was_recorded_resumes_as_format_1(saved_run, no_servers):  # noqa: F811
    assert "run_format" not in json.loads((saved_run / "run.json").read_text())
    from flows.cli import main

    with pytest.raises(AssertionError, match="a server was started"):  # past every check: it resumes
        main(["train", "--resume", str(saved_run), "trainer.total_iterations=20"])


def test_the_flow_refuses_too_and_records_format_1_on_an_old_folder(cfg):  # noqa: F811
    """A deployment's flow run has no CLI preflight: open_run checks the format itself."""
    first = open_run(cfg, resume=None)
    first.close()
    info = json.loads(open(first.dir.run_info_file).read())
    del info["run_format"]
    open(first.dir.run_info_file, "w").write(json.dumps(info))
    again = open_run(cfg, resume=first.run_dir)
    again.close()
    assert json.loads(open(first.dir.run_info_file).read())["run_format"] == 1
    info["run_format"] = RUN_FORMAT + 1
    open(first.dir.run_info_file, "w").write(json.dumps(info))
    with pytest.raises(PreflightError, match="reads run formats 1 to"):
        open_run(cfg, resume=first.run_dir)
