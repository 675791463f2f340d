"""Services the CLI brings up once: a local Prefect server (unless PREFECT_API_URL points at one)
and Ray (local, or ``placement.ray_address``). Every Ray worker gets the same Prefect API
through the environment: Prefect's server-less ephemeral mode does not work under Ray (each
Ray worker would start its own and they lock the same SQLite file).

Servers started here bind to 127.0.0.1 and are stopped by the PID we started; a reaper process
(:mod:`flows.reaper`, :func:`start_reaper`) stops them, Ray's processes included, if the CLI dies
without doing so (SIGKILL). Local Ray runs with its node address on the loopback interface
(:func:`loopback_ray`), so every Ray server listens on 127.0.0.1 only.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.config import ExperimentConfig


@dataclass
class PrefectServer:
    url: str
    proc: subprocess.Popen | None  # None: we did not start it
    home: str

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api_healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout_s) as r:
            return r.status == 200
    except Exception:
        return False


def start_prefect_server(home: str | Path, *, port: int | None = None, timeout_s: float = 120.0) -> PrefectServer:
    """Start ``prefect server start`` on 127.0.0.1 with SQLite under ``home``; wait until healthy.

    Raises RuntimeError with the server's last log lines if it does not come up in time."""
    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": os.environ.get("PREFECT_UI_ENABLED", "true"),
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home}/prefect.db",
    }
    env.pop("PREFECT_API_URL", None)
    log = open(home / "server.log", "ab")
    prefect_bin = str(Path(sys.executable).with_name("prefect"))
    proc = subprocess.Popen(
        [prefect_bin, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        if api_healthy(url):
            return PrefectServer(url, proc, str(home))
        time.sleep(0.5)
    server = PrefectServer(url, proc, str(home))
    server.stop()
    tail = (home / "server.log").read_text(errors="replace").splitlines()[-15:]
    raise RuntimeError(f"Prefect server did not become healthy at {url} in {timeout_s}s:\n" + "\n".join(tail))


def ensure_prefect_api(home: str | Path) -> PrefectServer:
    """Use $PREFECT_API_URL when set (fails clearly if unreachable); else start a local server.
    Sets PREFECT_API_URL in this process's environment (inherited by Ray workers)."""
    url = os.environ.get("PREFECT_API_URL")
    if url:
        if not api_healthy(url, timeout_s=5):
            raise RuntimeError(f"PREFECT_API_URL={url} is not reachable (GET {url}/health failed)")
        return PrefectServer(url, None, "")
    server = start_prefect_server(home)
    os.environ["PREFECT_API_URL"] = server.url
    return server


def start_reaper() -> subprocess.Popen:
    """Start :mod:`flows.reaper` for this process: whatever this process starts from now on (the
    Prefect server, Ray and everything under them) is stopped once it exits, however it exits."""
    import psutil

    from flows.reaper import start_time

    me = psutil.Process()
    return subprocess.Popen(
        [sys.executable, "-m", "flows.reaper", str(me.pid), repr(start_time(me))],
        cwd=str(Path(__file__).resolve().parents[1]), start_new_session=True,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
    )  # fmt: skip


def loopback_ray() -> None:
    """Make a local Ray take 127.0.0.1 as its node address, so that its GCS, raylet, workers,
    dashboard agent (gRPC, HTTP and the metrics export port), runtime-env agent and autoscaler
    metrics server all bind 127.0.0.1 (Ray binds loopback only when the node address is loopback).

    ``ray.init(_node_ip_address="127.0.0.1")`` alone does not do it: Ray replaces a loopback
    address by the machine's routable one unless its single-machine mode is on
    (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, the default on macOS/Windows; ray 2.60
    ``ray._private.services.resolve_ip_for_localhost``). Ray reads that variable when imported:
    it is set in the environment (Ray's processes inherit it) and, if ray is already imported in
    this process, on its constants module as well."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False


def ensure_ray(cfg: ExperimentConfig) -> None:
    """Start local Ray (or join ``placement.ray_address``) once, passing the Prefect API and
    MLflow URI to every worker through ``runtime_env``."""
    import ray

    if ray.is_initialized():
        return
    env_vars = {k: os.environ[k] for k in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "HYBRIDFLOW_CACHE",
                                              "PYTHONPATH", "HYBRIDFLOW_CONSOLE",
                                              "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL") if k in os.environ}
    env_vars.setdefault("TOKENIZERS_PARALLELISM", "false")
    from flows.console import ray_init_options

    # quiet console (the CLI's default): workers' output stays in Ray's logs; -v prefixes it onto the driver's
    kwargs: dict = {"runtime_env": {"env_vars": env_vars}, "include_dashboard": False, "namespace": "hybridflow",
                    **ray_init_options()}
    if cfg.placement.ray_address:
        ray.init(address=cfg.placement.ray_address, **kwargs)
        return
    # Node tasks ask for zero CPUs, but Ray keeps only `num_cpus` idle workers warm; with pools holding
    # every CPU, each iteration would pay for new task-worker processes (Prefect + torch imports).
    os.environ.setdefault("RAY_num_workers_soft_limit", "8")
    # Ray's tqdm helper replaces print() in the driver, which undoes Prefect's log_prints
    os.environ.setdefault("RAY_TQDM_PATCH_PRINT", "0")
    # Ray starts workers at nice 15 by default; the pools' actors *are* the compute here, and at
    # nice 15 any other process (Prefect server, driver) takes the CPU from them on a small machine
    os.environ.setdefault("RAY_worker_niceness", "0")
    loopback_ray()
    needed = sum(p.workers * p.cpus_per_worker for p in cfg.placement.pools.values())
    num_cpus = cfg.placement.ray_num_cpus or max(float(os.cpu_count() or 1), needed)
    num_gpus = sum(p.workers * p.gpus_per_worker for p in cfg.placement.pools.values())
    _init_local_ray(num_cpus=int(-(-num_cpus // 1)), num_gpus=int(-(-num_gpus // 1)) or None,
                    _node_ip_address="127.0.0.1", **kwargs)


def _init_local_ray(attempts: int = 3, **kwargs: Any) -> None:
    """``ray.init`` of a local node, tried again when Ray gives up waiting for its own raylet
    (a fixed 30 s in ray/_private/node.py: "The current node timed out during startup"), which a
    loaded 2-core machine reached at load average 30; any other error is raised at once."""
    import ray

    for attempt in range(1, attempts + 1):
        try:
            ray.init(**kwargs)
            return
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception here
            if "timed out during startup" not in str(e) or attempt == attempts:
                raise
            ray.shutdown()
