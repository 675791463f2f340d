"""Registering the Prefect deployments of ``deployments/prefect.yaml`` (what ``hybridflow deploy`` does).

The project file (load, select, check the entrypoints, retarget at another work pool), the Prefect
API (find it, check its health, read and create work pools, read a deployment back) and the
``prefect deploy`` run itself. Each failure is a :class:`DeployError` phrased for the user (one line).
Only the standard library is imported at module level; prefect is imported lazily and only when
the API URL must come from a Prefect profile.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

PROJECT_DIR = Path(__file__).resolve().parents[1]
DEFAULT_PREFECT_YAML = "deployments/prefect.yaml"
DEPLOY_TIMEOUT_S = 600.0
_CREATED_RE = re.compile(r"Deployment '([^'/]+)/([^']+)' successfully created with id '([0-9a-fA-F-]{36})'")


class DeployError(RuntimeError):
    """A problem already phrased for the user (one line)."""


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


def pool_name(dep: dict[str, Any]) -> str:
    name = (dep.get("work_pool") or {}).get("name")
    if not name:
        raise DeployError(f"deployment {dep['name']!r} names no work pool (work_pool.name); pass --pool")
    return name


def dump_yaml(spec: dict[str, Any]) -> str:
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
