"""Services the CLI brings up once: a local Prefect server (unless PREFECT_API_URL points at one)
and Ray (local, or ``placement.ray_address``). Every Ray worker gets the same Prefect API
through the environment: Prefect's server-less ephemeral mode does not work under Ray (each
Ray worker would start its own and they lock the same SQLite file).

Servers started here bind to 127.0.0.1 and are stopped by the PID we started; a reaper process
(:mod:`flows.reaper`, :func:`start_reaper`) stops them, Ray's processes included, if the CLI dies
without doing so (SIGKILL). Local Ray runs with its node address on the loopback interface
(:func:`workers.runtime.loopback_ray`), so every Ray server listens on 127.0.0.1 only.
"""

from __future__ import annotations

import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from hybridflow.config import ExperimentConfig


@dataclass
class PrefectServer:
    url: str
    proc: subprocess.Popen | None  # None: we did not start it
    home: str

    def wait_healthy(self, timeout_s: float = 120.0) -> PrefectServer:
        """Until ``GET /health`` answers; a server we did not start is taken as it is. Stops the
        server and raises RuntimeError with its last log lines when it exits or is not healthy in
        ``timeout_s``."""
        if self.proc is None:
            return self
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if api_healthy(self.url):
                return self
            time.sleep(0.25)
        self.stop()
        tail = (Path(self.home) / "server.log").read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"Prefect server did not become healthy at {self.url} in {timeout_s}s:\n" + "\n".join(tail))

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


def prefect_database_template(timeout_s: float = 180.0) -> Path:
    """An empty Prefect database as ``prefect server start`` leaves it (every migration of the
    installed Prefect applied, its block types registered, no runs), made once per Prefect version
    under the cache (``$HYBRIDFLOW_CACHE``, else ``~/.cache/hybridflow``:
    ``prefect-db/<version>/prefect.db``) by starting and stopping a server on a private home.

    A new SQLite database costs a server start its whole migration history and the block
    registration (~23 s on 2 cores, AMD EPYC); a copy of this one starts in ~7 s. Made in a
    private folder and moved into place, so concurrent first runs each make one and one wins.
    Raises RuntimeError (the server's log tail) when that server does not come up."""
    from importlib.metadata import version

    from hybridflow.cache import cache_root

    target = cache_root() / "prefect-db" / version("prefect") / "prefect.db"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".making-", dir=target.parent))
    try:
        start_prefect_server(work, timeout_s=timeout_s, seed=False).stop()
        _copy_database(work / "prefect.db", work / "template.db")
        os.replace(work / "template.db", target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _copy_database(src: Path, dst: Path) -> None:
    """A consistent copy of SQLite database ``src`` at ``dst`` (SQLite's online backup: the
    write-ahead log included)."""
    with closing(sqlite3.connect(src)) as a, closing(sqlite3.connect(dst)) as b:
        a.backup(b)


def seed_prefect_database(home: str | Path) -> bool:
    """Give a Prefect home without a database a copy of :func:`prefect_database_template`; a home
    that has one (a resumed run's) keeps it. Returns whether it seeded one. Set
    ``HYBRIDFLOW_PREFECT_DB_TEMPLATE=0`` to let the server migrate a new database itself."""
    db = Path(home) / "prefect.db"
    if db.exists() or os.environ.get("HYBRIDFLOW_PREFECT_DB_TEMPLATE", "1") == "0":
        return False
    try:
        template = prefect_database_template()
    except OSError as e:  # a cache folder this user cannot write: the server migrates its own
        print(f"note: no Prefect database template ({e}); the server migrates a new database", file=sys.stderr)
        return False
    staged = db.with_name(".prefect.db.seeding")
    try:
        _copy_database(template, staged)
    except sqlite3.DatabaseError as e:  # a damaged template: dropped (made again next time); this server migrates
        staged.unlink(missing_ok=True)
        template.unlink(missing_ok=True)
        print(f"note: the Prefect database template {template} is unreadable ({e}); removed, the server "
              "migrates a new database", file=sys.stderr)
        return False
    os.replace(staged, db)
    return True


def launch_prefect_server(home: str | Path, *, port: int | None = None, seed: bool = True) -> PrefectServer:
    """Start ``prefect server start`` on 127.0.0.1 with SQLite under ``home`` and return at once,
    before it is healthy (:meth:`PrefectServer.wait_healthy`), so the caller can start Ray while it
    boots. A new home's database starts as a copy of the migrated template
    (:func:`seed_prefect_database`) unless ``seed`` is false."""
    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    if seed:
        seed_prefect_database(home)
    port = port or free_port()
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
    return PrefectServer(f"http://127.0.0.1:{port}/api", proc, str(home))


def start_prefect_server(
    home: str | Path, *, port: int | None = None, timeout_s: float = 120.0, seed: bool = True
) -> PrefectServer:
    """:func:`launch_prefect_server`, then wait until it is healthy.

    Raises RuntimeError with the server's last log lines if it does not come up in time."""
    return launch_prefect_server(home, port=port, seed=seed).wait_healthy(timeout_s)


def launch_prefect_api(home: str | Path) -> PrefectServer:
    """Use $PREFECT_API_URL when set (fails clearly if unreachable); else launch a local server
    under ``home`` (:func:`launch_prefect_server`): the caller waits for it
    (:meth:`PrefectServer.wait_healthy`) once it has started what can boot beside it (Ray).
    Sets PREFECT_API_URL in this process's environment (inherited by Ray workers) either way."""
    url = os.environ.get("PREFECT_API_URL")
    if url:
        if not api_healthy(url, timeout_s=5):
            raise RuntimeError(f"PREFECT_API_URL={url} is not reachable (GET {url}/health failed)")
        return PrefectServer(url, None, "")
    server = launch_prefect_server(home)
    set_prefect_api_url(server.url)
    return server


def set_prefect_api_url(url: str | None) -> None:
    """Export ``PREFECT_API_URL`` (or unset it, ``url=None``) for this process and the ones it starts,
    and make Prefect in this process use it now. Prefect builds its settings once, from the
    environment, when ``prefect`` is first imported (``prefect.context.GLOBAL_SETTINGS_CONTEXT``):
    when anything imported Prefect before the URL was exported (the signal set-up imports its flow
    engine), its flow runs would otherwise go to a server-less ephemeral API of their own
    (``~/.prefect/prefect.db``, an extra server process in the driver) instead of the run's server."""
    if url is None:
        os.environ.pop("PREFECT_API_URL", None)
    else:
        os.environ["PREFECT_API_URL"] = url
    context = sys.modules.get("prefect.context")
    if context is not None:
        context.refresh_global_settings_context()


_REAPER: list[subprocess.Popen] = []  # this process's reaper, once started


def start_reaper() -> subprocess.Popen:
    """Start :mod:`flows.reaper` for this process: whatever this process starts from now on (the
    Prefect server, Ray and everything under them) is stopped once it exits, however it exits.
    One reaper per process: it watches all of this process's descendants, so a process that runs
    several commands (a test session, a notebook calling ``flows.cli.main``) reuses the running one
    instead of adding a watcher, each polling the process tree every second, per command."""
    import psutil

    from flows.reaper import start_time

    if _REAPER and _REAPER[0].poll() is None:
        return _REAPER[0]
    me = psutil.Process()
    _REAPER[:] = [subprocess.Popen(
        [sys.executable, "-m", "flows.reaper", str(me.pid), repr(start_time(me))],
        cwd=str(Path(__file__).resolve().parents[1]), start_new_session=True,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
    )]  # fmt: skip
    return _REAPER[0]


def ensure_ray(cfg: ExperimentConfig) -> None:
    """Start local Ray (or join ``placement.ray_address``) once, passing the Prefect API and
    MLflow URI to every worker through ``runtime_env`` (:func:`workers.runtime.start_ray`)."""
    from workers.runtime import ray_running, start_ray

    if ray_running():
        return
    env_vars = {k: os.environ[k] for k in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "HYBRIDFLOW_CACHE",
                                              "PYTHONPATH", "HYBRIDFLOW_CONSOLE",
                                              "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL") if k in os.environ}
    env_vars.setdefault("TOKENIZERS_PARALLELISM", "false")
    from flows.console import ray_init_options

    # quiet console (the CLI's default): workers' output stays in Ray's logs; -v prefixes it onto the driver's
    kwargs: dict = {"runtime_env": {"env_vars": env_vars}, "include_dashboard": False, "namespace": "hybridflow",
                    **ray_init_options()}
    needed = sum(p.workers * p.cpus_per_worker for p in cfg.placement.pools.values())
    if cfg.trainer.eval.enabled and not any("evaluator" in p.roles for p in cfg.placement.pools.values()):
        needed += cfg.trainer.eval.cpus  # the harness evaluations' pool (flows/harness_eval.py)
    num_cpus = cfg.placement.ray_num_cpus or max(float(os.cpu_count() or 1), needed)
    num_gpus = sum(p.workers * p.gpus_per_worker for p in cfg.placement.pools.values())
    start_ray(address=cfg.placement.ray_address, num_cpus=num_cpus, num_gpus=num_gpus, **kwargs)
