"""A throw-away PostgreSQL server for tests, and the Prefect and MLflow servers on it: ``initdb`` into a temp folder, ``pg_ctl start`` on
127.0.0.1 with a free port (its Unix socket in that folder too), stopped with ``pg_ctl stop``
(fast, then immediate). The binaries come from Debian's ``postgresql`` package (``make
test-cluster`` installs it when missing): ``initdb``/``pg_ctl`` on PATH or under
/usr/lib/postgresql/<version>/bin."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from workers.distributed import find_free_port


def pg_bin(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)),
                                       None)
    if not found:
        raise RuntimeError(f"PostgreSQL's {name} is not installed (Debian: apt-get install -y postgresql)")
    return found


@dataclass
class Postgres:
    data: Path
    port: int
    user: str = "hybridflow"

    def url(self, driver: str, db: str) -> str:
        return f"postgresql+{driver}://{self.user}@127.0.0.1:{self.port}/{db}" if driver else \
            f"postgresql://{self.user}@127.0.0.1:{self.port}/{db}"

    def _run(self, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        subprocess.run(list(args), check=True, capture_output=True, timeout=120, env=env,
                       **({"user": "postgres"} if os.geteuid() == 0 else {}))

    def start(self) -> Postgres:
        self.data.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:  # postgres refuses to run as root
            shutil.chown(self.data, "postgres")
        self._run(pg_bin("initdb"), "-D", str(self.data / "db"), "-U", self.user, "--auth=trust", "-E", "UTF8")
        opts = f"-h 127.0.0.1 -p {self.port} -k {self.data}"
        self._run(pg_bin("pg_ctl"), "-D", str(self.data / "db"), "-o", opts, "-l", str(self.data / "server.log"),
                  "-w", "-t", "120", "start")
        return self

    def create_db(self, name: str) -> None:
        self._run(pg_bin("createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user, name)

    def query(self, db: str, sql: str) -> str:
        """One SQL statement through psql; its unaligned output."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        out = subprocess.run([pg_bin("psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user, "-d", db,
                              "-At", "-c", sql], check=True, capture_output=True, text=True, timeout=60, env=env)
        return out.stdout.strip()

    def stop(self) -> None:
        for mode in ("fast", "immediate"):
            try:
                self._run(pg_bin("pg_ctl"), "-D", str(self.data / "db"), "-m", mode, "-w", "-t", "60", "stop")
                return
            except subprocess.CalledProcessError:
                continue


def start_postgres(data: Path) -> Postgres:
    return Postgres(data, find_free_port()).start()


@dataclass
class Server:
    """A server process in its own process group, at ``url``."""

    url: str
    proc: subprocess.Popen

    def stop(self) -> None:
        import signal

        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=20)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue


def start_prefect_on_postgres(pg: Postgres, home: Path, timeout_s: float = 300) -> Server:
    """``prefect server start`` on 127.0.0.1 with PREFECT_API_DATABASE_CONNECTION_URL on ``pg``
    (database ``prefect``); waits until /api/health answers. Its own process group."""
    import sys

    pg.create_db("prefect")
    port = find_free_port()
    home.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_ENABLED": "false", "PREFECT_API_DATABASE_CONNECTION_URL": pg.url("asyncpg", "prefect"),
           # a run refused by a deployment's concurrency limit is scheduled again this many seconds
           # later (AwaitingConcurrencySlot; Prefect's default is 30)
           "PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS": "2"}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen([str(Path(sys.executable).with_name("prefect")), "server", "start", "--host", "127.0.0.1",
                             "--port", str(port)], env=env, stdout=open(home / "server.log", "ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}/api", proc)
    wait_healthy(server, home / "server.log", timeout_s)
    return server


def start_mlflow_on_postgres(pg: Postgres, home: Path) -> Server:
    """``mlflow server`` on 127.0.0.1 with its backend store on ``pg`` (database ``mlflow``, as
    ``postgresql+psycopg2://``: SQLAlchemy 2.1 maps a bare ``postgresql://`` to psycopg 3, which is
    not installed) and artifacts served over HTTP from ``home/artifacts``
    (``--artifacts-destination``): clients never see that folder. Returns at once;
    :func:`wait_healthy` waits for /health (the first start creates MLflow's tables: ~45 s here)."""
    import sys

    pg.create_db("mlflow")
    port = find_free_port()
    home.mkdir(parents=True, exist_ok=True)
    cmd = [str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri", pg.url("psycopg2", "mlflow"),
           "--artifacts-destination", str(home / "artifacts"), "--serve-artifacts",
           "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PG"))}
    proc = subprocess.Popen(cmd, cwd=home, env=env, stdout=open(home / "server.log", "ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    return Server(f"http://127.0.0.1:{port}", proc)


def wait_healthy(server: Server, log: Path, timeout_s: float = 300) -> None:
    """Until ``GET {url}/health`` answers 200; RuntimeError with the log's tail when the server
    exits or ``timeout_s`` passes."""
    import time

    from flows.runtime import api_healthy

    deadline = time.monotonic() + timeout_s
    while not api_healthy(server.url):
        if server.proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"{server.url} did not come up:\n" + log.read_text(errors="replace")[-3000:])
        time.sleep(0.5)
