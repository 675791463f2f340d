"""``hybridflow deploy`` without a server: argument handling, the unreachable-API error, retargeting
the project file at another work pool, and reading Prefect's output.

The run against a real Prefect server (deploy, worker, flow run) is an integration test.
"""

from __future__ import annotations

import argparse
import re
import socket
from pathlib import Path

import pytest
import yaml

from flows import deployments
from flows.cli import build_parser
from flows.cli import deploy as cli_deploy

ROOT = Path(__file__).resolve().parents[2]
PREFECT_YAML = ROOT / "deployments" / "prefect.yaml"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed when the with block ends: nothing listens there


def test_unreachable_api_is_one_line_naming_the_url(capsys):
    url = f"http://127.0.0.1:{_closed_port()}/api"
    args = build_parser().parse_args(["deploy", "-n", "train", "--api-url", url, "--timeout-s", "2"])
    assert cli_deploy.run(args) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"hybridflow deploy: no Prefect server reachable at {url} (GET {url}/health: ")
    assert "prefect server start --host 127.0.0.1" in err


def test_unknown_deployment_name_lists_the_known_ones(capsys):
    args = build_parser().parse_args(["deploy", "--api-url", "http://127.0.0.1:9/api", "-n", "nightly"])
    assert cli_deploy.run(args) == 1  # fails on the name before contacting any server
    err = capsys.readouterr().err
    assert "unknown deployment nightly; the file has: train, evaluate-nightly, lm-eval-latest, continue-training" in err


def test_missing_project_file_is_reported(tmp_path, capsys):
    args = build_parser().parse_args(["deploy", "--project-dir", str(tmp_path)])
    assert cli_deploy.run(args) == 1
    assert (
        f"no Prefect project file at {tmp_path / 'deployments' / 'prefect.yaml'}" in capsys.readouterr().err
    )


def test_missing_entrypoint_file_is_reported_before_any_server_call(tmp_path, capsys):
    (tmp_path / "deployments").mkdir()
    (tmp_path / "deployments" / "prefect.yaml").write_text(PREFECT_YAML.read_text())
    (tmp_path / "flows").mkdir()
    (tmp_path / "flows" / "train.py").write_text("")
    args = build_parser().parse_args(
        ["deploy", "--project-dir", str(tmp_path), "--api-url", "http://127.0.0.1:9/api"]
    )
    assert cli_deploy.run(args) == 1
    err = capsys.readouterr().err
    assert (
        f"deployment 'evaluate-nightly': entrypoint file flows/evaluate.py does not exist in {tmp_path}"
        in err
    )


def test_api_url_prefers_the_flag_then_the_environment(monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", "http://env:4200/api/")
    assert deployments.resolve_api_url(None) == "http://env:4200/api"  # trailing slash dropped
    assert deployments.resolve_api_url("http://flag:1/api") == "http://flag:1/api"


def test_retarget_to_a_process_pool_only_renames_it():
    spec = deployments.load_prefect_yaml(PREFECT_YAML)
    before = yaml.safe_dump(spec)
    out = deployments.retarget(spec, "other-pool", "process")
    assert yaml.safe_dump(spec) == before  # the input is not modified (its pools are shared YAML aliases)
    for dep in out["deployments"]:
        assert dep["work_pool"] == {"name": "other-pool", "job_variables": {}}
        assert "pull" not in dep


def test_retarget_to_kubernetes_takes_job_variables_and_pull_steps():
    spec = deployments.load_prefect_yaml(PREFECT_YAML)
    k8s = spec["definitions"]["work_pools"]["kubernetes"]
    out = deployments.retarget(spec, "my-k8s", "kubernetes")
    for dep in out["deployments"]:
        assert dep["work_pool"]["name"] == "my-k8s"
        assert dep["work_pool"]["job_variables"] == k8s["job_variables"]
        assert dep["work_pool"]["job_variables"] is not k8s["job_variables"]
        assert dep["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": "/app"}}]
    # the rewritten file is plain YAML (no anchors) that loads back to the same mapping
    text = deployments.dump_yaml(out)
    assert not re.search(r"[&*]id\d{3}", text)  # PyYAML names its anchors id001, id002, ...
    assert yaml.safe_load(text) == out


def test_created_deployments_are_read_from_prefects_output():
    # lines as `prefect deploy` 3.9.1 printed them (rich panels, COLUMNS=240)
    out = (
        "│ Deployment 'train/train' successfully created with id "
        "'0416d105-0129-4a1b-bf8b-821d4810fcdf'.          │\n"
        "View Deployment in UI: http://127.0.0.1:38485/deployments/deployment/0416d105\n"
        "│ Deployment 'evaluate/evaluate-nightly' successfully created with id "
        "'ba3062cb-1afe-46cb-832e-a4bdbf69ba26'.  │\n"
    )
    found = [m.groups() for m in deployments._CREATED_RE.finditer(out)]
    assert found == [
        ("train", "train", "0416d105-0129-4a1b-bf8b-821d4810fcdf"),
        ("evaluate", "evaluate-nightly", "ba3062cb-1afe-46cb-832e-a4bdbf69ba26"),
    ]


def test_describe_deployment_summarises_pool_and_schedules(monkeypatch):
    # the shape GET /api/deployments/{id} returned from a Prefect 3.9.1 server
    api_answer = {
        "work_pool_name": "hybridflow-process",
        "entrypoint": "flows/train.py:train",
        "schedules": [
            {"schedule": {"cron": "0 2 * * *", "timezone": "UTC", "day_or": True}, "active": True},
            {"schedule": {"interval": 21600.0, "timezone": "UTC"}, "active": False},
        ],
    }
    monkeypatch.setattr(deployments, "_get_json", lambda url, timeout_s: api_answer)
    line = deployments.describe_deployment("http://x/api", "train", "t", "id-1", 1.0)
    assert line == (
        "registered train/t  id=id-1  pool=hybridflow-process  entrypoint=flows/train.py:train  "
        "schedules=cron '0 2 * * *'; every 21600.0 s (paused)"
    )


def test_module_imports_no_heavy_library():
    import subprocess
    import sys

    code = (
        "import sys, flows.cli.deploy, flows.deployments; "
        "heavy = {'prefect', 'ray', 'torch', 'mlflow'} & {m.split('.')[0] for m in sys.modules}; "
        "print(sorted(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_add_arguments_defaults():
    p = argparse.ArgumentParser()
    cli_deploy.add_arguments(p)
    args = p.parse_args([])
    assert args.prefect_yaml == "deployments/prefect.yaml"
    assert args.pool is None and args.pool_type == "process" and args.name == []
    assert Path(args.project_dir) == ROOT


@pytest.mark.parametrize(
    "names,expected", [([], ["train", "evaluate-nightly", "lm-eval-latest", "continue-training"]), (["train"], ["train"])]
)
def test_select_deployments(names, expected):
    spec = deployments.load_prefect_yaml(PREFECT_YAML)
    assert deployments.select_deployments(spec, names) == expected
