"""A throw-away PostgreSQL server for tests: ``initdb`` into a temp folder, ``pg_ctl start`` on
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
class PrefectOnPostgres:
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


def start_prefect_on_postgres(pg: Postgres, home: Path, timeout_s: float = 300) -> PrefectOnPostgres:
    """``prefect server start`` on 127.0.0.1 with PREFECT_API_DATABASE_CONNECTION_URL on ``pg``
    (database ``prefect``); waits until /api/health answers. Its own process group."""
    import sys
    import time

    from flows.runtime import api_healthy

    pg.create_db("prefect")
    port = find_free_port()
    home.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_ENABLED": "false", "PREFECT_API_DATABASE_CONNECTION_URL": pg.url("asyncpg", "prefect")}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen([str(Path(sys.executable).with_name("prefect")), "server", "start", "--host", "127.0.0.1",
                             "--port", str(port)], env=env, stdout=open(home / "server.log", "ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    server = PrefectOnPostgres(f"http://127.0.0.1:{port}/api", proc)
    deadline = time.monotonic() + timeout_s
    while not api_healthy(server.url):
        if proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError("Prefect server on PostgreSQL did not come up:\n"
                               + (home / "server.log").read_text(errors="replace")[-3000:])
        time.sleep(0.5)
    return server
