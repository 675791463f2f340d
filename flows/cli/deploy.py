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
The steps are :mod:`flows.deployments`; this module parses the arguments and prints. Only the
standard library is imported at module level (prefect only when the API URL must come from a
Prefect profile).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from flows.deployments import (
    DEFAULT_PREFECT_YAML,
    PROJECT_DIR,
    DeployError,
    check_api,
    check_entrypoints,
    describe_deployment,
    dump_yaml,
    ensure_work_pool,
    load_prefect_yaml,
    pool_name,
    read_work_pool,
    resolve_api_url,
    retarget,
    run_prefect_deploy,
    select_deployments,
)


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
    for pool in sorted({pool_name(d) for d in spec["deployments"] if d["name"] in selected}):
        ensure_work_pool(api, pool, pool_type, project, args.timeout_s)

    with tempfile.TemporaryDirectory(prefix="hybridflow-deploy-") as tmp:
        deploy_file = yaml_path
        if args.pool:
            deploy_file = Path(tmp) / "prefect.yaml"
            deploy_file.write_text(dump_yaml(spec))
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
    pools = sorted({pool_name(d) for d in spec["deployments"] if d["name"] in selected})
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
