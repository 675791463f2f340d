"""``hybridflow deploy``: register the Prefect deployments of ``deployments/prefect.yaml``.

Steps; a failure stops the command with a message on stderr that names what failed:

0. check that each selected deployment's entrypoint file exists under the project directory;
1. find the Prefect API (``--api-url``, else ``$PREFECT_API_URL``, else the active Prefect
   profile) and check that ``GET {api}/health`` answers within ``--timeout-s``;
2. make sure every work pool the deployments name exists (``prefect work-pool create NAME
   --type process`` when missing);
3. run ``prefect --no-prompt deploy --all --prefect-file deployments/prefect.yaml`` (or
   ``--name`` for a subset) from the project directory, so entrypoints such as
   ``flows/train.py:train`` resolve and workers run in that directory;
4. read each created deployment back from the API and print what was registered;
5. create the automations of ``deployments/automations.yaml`` (``--automations``; replaced by
   name; ``--no-automations`` skips them): e.g. pause a run's deployment when the run stops on
   NaN updates or its validation accuracy falls (``flows/automations.py``).

``--pool NAME`` retargets every deployment at another pool through a rewritten copy of the
file (``prefect deploy --all`` ignores ``--pool``); when that pool's type has an entry under
``definitions.work_pools`` (e.g. ``kubernetes``), its job variables and pull steps come along.
Only the standard library is imported at module level; prefect is imported lazily and only
when the API URL must come from a Prefect profile.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

PROJECT_DIR = Path(__file__).resolve().parents[2]
DEFAULT_PREFECT_YAML = "deployments/prefect.yaml"
DEPLOY_TIMEOUT_S = 600.0
_CREATED_RE = re.compile(r"Deployment '([^'/]+)/([^']+)' successfully created with id '([0-9a-fA-F-]{36})'")


class DeployError(RuntimeError):
    """A problem already phrased for the user (one line)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefect-yaml",
        default=DEFAULT_PREFECT_YAML,
        help=f"Prefect project file, relative to --project-dir (default: {DEFAULT_PREFECT_YAML})",
    )
    p.add_argument(
        "-n",
        "--name",
        action="append",
        default=[],
        metavar="DEPLOYMENT",
        help="deploy only this deployment (repeatable; default: all in the file)",
    )
    p.add_argument("--pool", help="work pool for every deployment, overriding the file's work_pool.name")
    p.add_argument(
        "--pool-type",
        default="process",
        help="type of a work pool that must be created because it does not exist (default: process)",
    )
    p.add_argument(
        "--api-url", help="Prefect API URL (default: $PREFECT_API_URL or the active Prefect profile)"
    )
    p.add_argument(
        "--project-dir",
        default=str(PROJECT_DIR),
        help="directory the deploy runs in; entrypoints are relative to it (default: the repository root)",
    )
    p.add_argument("--timeout-s", type=float, default=5.0, help="seconds to wait for the API health check")
    p.add_argument("--automations", default="deployments/automations.yaml",
                   help="Prefect automations file, relative to --project-dir (default: deployments/automations.yaml)")
    p.add_argument("--no-automations", action="store_true", help="register the deployments only")


def run(args: argparse.Namespace) -> int:
    try:
        return _deploy(args)
    except DeployError as e:
        print(f"hybridflow deploy: {e}", file=sys.stderr)
        return 1


def _deploy(args: argparse.Namespace) -> int:
    project = Path(args.project_dir).resolve()
    yaml_path = (project / args.prefect_yaml).resolve()
    spec = load_prefect_yaml(yaml_path)
    selected = select_deployments(spec, args.name)
    check_entrypoints(spec, selected, project)
    api = resolve_api_url(args.api_url)
    check_api(api, args.timeout_s)

    pool_type = args.pool_type
    if args.pool:
        pool_type = (read_work_pool(api, args.pool, args.timeout_s) or {}).get("type", args.pool_type)
        spec = retarget(spec, args.pool, pool_type)
    for pool in sorted({_pool_name(d) for d in spec["deployments"] if d["name"] in selected}):
        ensure_work_pool(api, pool, pool_type, project, args.timeout_s)

    with tempfile.TemporaryDirectory(prefix="hybridflow-deploy-") as tmp:
        deploy_file = yaml_path
        if args.pool:
            deploy_file = Path(tmp) / "prefect.yaml"
            deploy_file.write_text(_dump_yaml(spec))
        created = run_prefect_deploy(api, project, deploy_file, args.name)

    missing = sorted(set(selected) - {name for _, name, _ in created})
    if missing:
        raise DeployError(
            f"prefect deploy exited 0 but did not register {', '.join(missing)} (see its output above)"
        )
    for flow_name, name, dep_id in created:
        print(describe_deployment(api, flow_name, name, dep_id, args.timeout_s))
    if not args.no_automations:
        deploy_automations(api, project / args.automations)
    pools = sorted({_pool_name(d) for d in spec["deployments"] if d["name"] in selected})
    print(f"next: prefect worker start --pool {pools[0]}   (against {api})")
    return 0


def deploy_automations(api: str, path: Path) -> None:
    """Create the automations of ``path`` (flows/automations.py) and print one line each."""
    from flows.automations import AutomationError, create_automations

    try:
        for name, automation_id in create_automations(api, path):
            print(f"automation {name}  id={automation_id}")
    except AutomationError as e:
        raise DeployError(str(e)) from None


# ---- the project file ----------------------------------------------------------------------------


def load_prefect_yaml(path: Path) -> dict[str, Any]:
    """Read a prefect.yaml; raises DeployError when missing, not YAML, or without named deployments."""
    import yaml

    if not path.is_file():
        raise DeployError(f"no Prefect project file at {path}")
    try:
        spec = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise DeployError(f"{path} is not valid YAML: {e}") from None
    deployments = spec.get("deployments") if isinstance(spec, dict) else None
    if not deployments or not all(isinstance(d, dict) and d.get("name") for d in deployments):
        raise DeployError(f"{path}: 'deployments' must be a non-empty list of mappings with a 'name'")
    return spec


def select_deployments(spec: dict[str, Any], names: list[str]) -> list[str]:
    """The deployment names to register: all of them, or ``names`` after checking each exists."""
    known = [d["name"] for d in spec["deployments"]]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise DeployError(f"unknown deployment {', '.join(unknown)}; the file has: {', '.join(known)}")
    return list(names) or known


def check_entrypoints(spec: dict[str, Any], selected: list[str], project: Path) -> None:
    """Each selected deployment's ``path/to/file.py:function`` file must exist under ``project``."""
    for dep in spec["deployments"]:
        if dep["name"] not in selected:
            continue
        entrypoint = dep.get("entrypoint") or ""
        path, _, func = entrypoint.rpartition(":")
        if not path or not func:
            raise DeployError(
                f"deployment {dep['name']!r}: entrypoint {entrypoint!r} is not path/to/file.py:function"
            )
        if not (project / path).is_file():
            raise DeployError(
                f"deployment {dep['name']!r}: entrypoint file {path} does not exist in {project}"
            )


def retarget(spec: dict[str, Any], pool: str, pool_type: str) -> dict[str, Any]:
    """A deep copy of ``spec`` whose deployments all use work pool ``pool``.

    When ``definitions.work_pools[pool_type]`` exists, its ``job_variables`` replace each
    deployment's and its ``pull`` steps (if any) become the deployment's pull steps; otherwise
    only the pool name changes. ``spec`` itself is not modified.
    """
    out = copy.deepcopy(spec)
    template = ((out.get("definitions") or {}).get("work_pools") or {}).get(pool_type)
    for dep in out["deployments"]:
        work_pool = dict(dep.get("work_pool") or {})
        work_pool["name"] = pool
        if template:
            work_pool["job_variables"] = copy.deepcopy(template.get("job_variables") or {})
            if template.get("pull"):
                dep["pull"] = copy.deepcopy(template["pull"])
        work_pool.pop("pull", None)
        dep["work_pool"] = work_pool
    return out


def _pool_name(dep: dict[str, Any]) -> str:
    name = (dep.get("work_pool") or {}).get("name")
    if not name:
        raise DeployError(f"deployment {dep['name']!r} names no work pool (work_pool.name); pass --pool")
    return name


def _dump_yaml(spec: dict[str, Any]) -> str:
    import yaml

    class _NoAliases(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    return yaml.dump(spec, Dumper=_NoAliases, sort_keys=False)


# ---- the Prefect API -----------------------------------------------------------------------------


def resolve_api_url(explicit: str | None) -> str:
    """``explicit``, else ``$PREFECT_API_URL``, else the active Prefect profile's ``api.url``."""
    url = explicit or os.environ.get("PREFECT_API_URL")
    if not url:
        from prefect.settings import get_current_settings  # only here: importing prefect takes seconds

        url = get_current_settings().api.url
    if not url:
        raise DeployError(
            "no Prefect API configured: start one with `prefect server start --host 127.0.0.1` "
            "and set PREFECT_API_URL=http://127.0.0.1:4200/api (or pass --api-url)"
        )
    return url.rstrip("/")


def _get_json(url: str, timeout_s: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.loads(resp.read() or b"null")


def check_api(api: str, timeout_s: float) -> None:
    """GET {api}/health; raises DeployError naming the URL when it does not answer 200."""
    url = f"{api}/health"
    try:
        _get_json(url, timeout_s)
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise DeployError(
            f"no Prefect server reachable at {api} (GET {url}: {reason}); "
            "start one with `prefect server start --host 127.0.0.1` or fix PREFECT_API_URL"
        ) from None


def read_work_pool(api: str, pool: str, timeout_s: float) -> dict[str, Any] | None:
    """The work pool as the API returns it, or None when it does not exist (HTTP 404)."""
    try:
        return _get_json(f"{api}/work_pools/{urllib.parse.quote(pool, safe='')}", timeout_s)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise DeployError(f"reading work pool {pool!r} from {api} failed: HTTP {e.code}") from None
    except (urllib.error.URLError, OSError) as e:
        raise DeployError(
            f"reading work pool {pool!r} from {api} failed: {getattr(e, 'reason', e)}"
        ) from None


def ensure_work_pool(api: str, pool: str, pool_type: str, project: Path, timeout_s: float) -> None:
    """Create work pool ``pool`` of type ``pool_type`` with the Prefect CLI unless it exists."""
    if read_work_pool(api, pool, timeout_s) is not None:
        print(f"work pool {pool!r} exists")
        return
    proc = _prefect(["work-pool", "create", pool, "--type", pool_type], api, project, timeout_s=120)
    if proc.returncode != 0:
        raise DeployError(f"`prefect work-pool create {pool} --type {pool_type}` failed:\n{_tail(proc)}")
    print(f"created work pool {pool!r} (type {pool_type})")


def run_prefect_deploy(
    api: str, project: Path, prefect_file: Path, names: list[str]
) -> list[tuple[str, str, str]]:
    """Run ``prefect --no-prompt deploy`` in ``project``; returns (flow, deployment, id) per creation."""
    select = [a for n in names for a in ("--name", n)] or ["--all"]
    proc = _prefect(["deploy", *select, "--prefect-file", str(prefect_file)], api, project, DEPLOY_TIMEOUT_S)
    if proc.returncode != 0:
        raise DeployError(f"prefect deploy failed (exit {proc.returncode}):\n{_tail(proc)}")
    return [m.groups() for m in _CREATED_RE.finditer(proc.stdout + proc.stderr)]


def describe_deployment(api: str, flow_name: str, name: str, dep_id: str, timeout_s: float) -> str:
    """One line: what the API now holds for this deployment (pool, schedules, entrypoint)."""
    dep = _get_json(f"{api}/deployments/{dep_id}", timeout_s)
    schedules = []
    for s in dep.get("schedules") or []:
        sched = s["schedule"]
        what = f"cron {sched['cron']!r}" if "cron" in sched else f"every {sched.get('interval')} s"
        schedules.append(what + ("" if s.get("active") else " (paused)"))
    return (
        f"registered {flow_name}/{name}  id={dep_id}  pool={dep.get('work_pool_name')}  "
        f"entrypoint={dep.get('entrypoint')}  schedules={'; '.join(schedules) or 'none'}"
    )


def _prefect(argv: list[str], api: str, project: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PREFECT_API_URL": api,
        "COLUMNS": "240",
    }  # wide: rich must not wrap the lines we parse
    cmd = [sys.executable, "-m", "prefect", "--no-prompt", *argv]
    try:
        proc = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise DeployError(f"`prefect {' '.join(argv)}` did not finish within {timeout_s:.0f} s") from None
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    return proc


def _tail(proc: subprocess.CompletedProcess[str], lines: int = 20) -> str:
    return "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-lines:])
