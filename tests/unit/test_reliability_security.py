"""Security promises: no pickle is read from disk by the product's code; a checkpoint folder that
holds a pickle instead of safetensors is refused without unpickling it; servers the product
starts bind 127.0.0.1; secrets never become MLflow params or artifacts."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PRODUCT_DIRS = ("hybridflow", "workers", "tasks", "flows")
# module aliases whose .load/.loads unpickle (torch.load without weights_only=True does too)
UNPICKLERS = {"pickle", "cPickle", "dill", "cloudpickle", "joblib", "torch", "_pickle"}


def _unsafe_loads(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value
        name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
        kwargs = {k.arg: k.value for k in node.keywords}
        if node.func.attr in ("load", "loads", "Unpickler") and name in UNPICKLERS:
            found.append(f"{name}.{node.func.attr} (line {node.lineno})")
        elif node.func.attr == "load" and name in ("np", "numpy"):
            allow = kwargs.get("allow_pickle")
            if isinstance(allow, ast.Constant) and allow.value:
                found.append(f"{name}.load(allow_pickle=True) (line {node.lineno})")
    return found


# The one reviewed exception, by file and count: an environment instance travels between the
# environment worker processes of one rollout as a pickle made by those processes from the user's
# own environment class (the same trust as multiprocessing's pipes, which pickle too). It is never
# written to disk and never comes from the run folder or from model-written code (the python tool
# runs in the sandbox and returns text).
IN_MEMORY_IPC = {"hybridflow/agents/remote.py": 1}


def test_product_code_never_unpickles():
    offenders = {}
    for folder in PRODUCT_DIRS:
        for path in sorted((REPO / folder).rglob("*.py")):
            hits = _unsafe_loads(ast.parse(path.read_text(), str(path)))
            rel = str(path.relative_to(REPO))
            if hits and len(hits) != IN_MEMORY_IPC.get(rel):
                offenders[rel] = hits
    assert offenders == {}
    for rel in IN_MEMORY_IPC:  # the exception keeps its promise: nothing of it touches a file
        text = (REPO / rel).read_text()
        assert "open(" not in text and "write_bytes" not in text and "fsspec" not in text


def test_the_scan_finds_what_it_looks_for():
    """The scan above must be able to fail."""
    code = "import pickle, torch, numpy as np\npickle.load(f)\ntorch.load('x.pt')\nnp.load('a', allow_pickle=True)\n"
    assert len(_unsafe_loads(ast.parse(code))) == 3


class _Boom:
    """Unpickling this creates a marker file: proof that a pickle was executed."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_checkpoint_with_a_pickle_instead_of_safetensors_is_refused(tmp_path):
    from tests.unit._worker_helpers import tiny_cfg
    from workers import checkpoint as C
    from workers.policy import PolicyWorker

    worker = PolicyWorker(tiny_cfg())
    step = Path(C.begin_save(tmp_path, 1))
    worker.save_checkpoint(str(step))
    C.commit_save(tmp_path, 1, {})
    final = Path(C.load_latest(tmp_path))
    marker = tmp_path / "pwned"
    for f in (final / "policy").glob("*.safetensors"):  # an attacker swaps the weights for a pickle
        f.unlink()
    (final / "policy" / "pytorch_model.bin").write_bytes(pickle.dumps(_Boom(str(marker))))
    with pytest.raises(C.CheckpointError, match="holds no .safetensors file"):
        worker.load_checkpoint(str(final))
    assert not marker.exists()


def test_prefect_server_is_started_on_localhost(tmp_path, monkeypatch):
    import flows.runtime as R

    seen = {}

    class FakeProc:
        pid = 0

        def __init__(self, args, env, **kwargs):
            seen.update(args=args, env=env, kwargs=kwargs)

        def poll(self):
            return None

    monkeypatch.setattr(R.subprocess, "Popen", FakeProc)
    monkeypatch.setattr(R, "api_healthy", lambda url, timeout_s=2.0: True)
    server = R.start_prefect_server(tmp_path, port=4321, seed=False)
    assert server.url == "http://127.0.0.1:4321/api"
    args = seen["args"]
    assert args[args.index("--host") + 1] == "127.0.0.1"
    assert seen["env"]["PREFECT_SERVER_API_HOST"] == "127.0.0.1"
    assert seen["kwargs"]["start_new_session"] is True  # stopped by the PID we started, not by name


def test_local_ray_is_started_on_localhost_without_dashboard(monkeypatch):
    import ray

    import flows.runtime as R
    from tests.unit._worker_helpers import tiny_cfg

    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw))
    R.ensure_ray(tiny_cfg())
    assert seen["_node_ip_address"] == "127.0.0.1"
    assert seen["include_dashboard"] is False


def test_credentials_in_uris_are_redacted_from_params_and_config_artifact(monkeypatch):
    import mlflow.tracking

    from flows.tracking import Tracker
    from tests.unit._worker_helpers import tiny_cfg

    cfg = tiny_cfg("tracking.mlflow_uri=https://alice:s3cret-pw@mlflow.example:5000",
                   "placement.ray_address=ray://bob:hunter2@head:10001")
    logged: list[str] = []

    class Client:  # records what would be sent to the tracking server
        def __init__(self, uri):
            pass

        def get_experiment_by_name(self, name):
            return None

        def create_experiment(self, name):
            return "1"

        def set_experiment_tag(self, experiment_id, key, value):
            logged.append(f"{key}={value}")

        def create_run(self, experiment_id, run_name, tags):
            return type("Run", (), {"info": type("Info", (), {"run_id": "r"})})

        def log_batch(self, run_id, params=()):
            logged.extend(f"{p.key}={p.value}" for p in params)

        def log_text(self, run_id, text, name):
            logged.append(text)

    monkeypatch.setattr(mlflow.tracking, "MlflowClient", Client)
    monkeypatch.setattr(mlflow, "set_tracking_uri", lambda uri: None)
    Tracker(cfg, run_name="sec")
    text = "\n".join(logged)
    assert "tracking.mlflow_uri=https://***@mlflow.example:5000" in text
    assert "placement.ray_address=ray://***@head:10001" in text
    assert "mlflow_uri: https://***@mlflow.example:5000" in text  # the config.yaml artifact
    assert "s3cret-pw" not in text and "hunter2" not in text
