"""``make test-vllm`` runs these (infra/vllm/test.sh): engine/ inside the vLLM runtime, driver/ from the
default runtime with the vLLM runtime built. A bare ``pytest`` elsewhere leaves them out instead of
failing on a missing runtime; test.sh fails when nothing is collected (pytest exit 5)."""

import importlib.util
from pathlib import Path

_RUNTIME = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
collect_ignore_glob = []
if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob.append("engine/*")
if not _RUNTIME.exists():
    collect_ignore_glob.append("driver/*")
