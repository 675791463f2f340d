"""Services for the cluster tests (``make test-cluster``; ``make test`` skips this folder): a real
two-node Ray cluster, a PostgreSQL server and the Prefect and MLflow servers on it, started here on
loopback addresses and stopped by the process groups and PIDs we started."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.cluster.postgres import (
    start_mlflow_on_postgres,
    start_postgres,
    start_prefect_on_postgres,
    wait_healthy,
)
from tests.cluster.ray_cluster import REPO, LocalRayCluster, cluster_env
from tests.train_process import start_train

VARIED_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Deterministic and varied between samples, so every update moves the weights."""
    return (sum(map(ord, solution_str)) % 97) / 96.0
'''


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server of our own (data in a temp folder the postgres user may enter)."""
    import shutil
    import tempfile

    pg = start_postgres(Path(tempfile.mkdtemp(prefix="hfc-pg-")))
    try:
        yield pg
    finally:
        pg.stop()
        shutil.rmtree(pg.data, ignore_errors=True)


@pytest.fixture(scope="session")
def prefect_api(postgres, tmp_path_factory):
    """The Prefect server every run here reports to, with its database on PostgreSQL."""
    server = start_prefect_on_postgres(postgres, tmp_path_factory.mktemp("prefect-home"))
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def mlflow_server(postgres, tmp_path_factory):
    """``mlflow server`` with its backend store on PostgreSQL (tests/cluster/postgres.py); the URL.
    Requested before the cluster and the Prefect server, it starts while they start: the
    fixture waits for its /health only after the others are up (``mlflow_url``)."""
    home = tmp_path_factory.mktemp("mlflow-pg")
    server = start_mlflow_on_postgres(postgres, home)
    try:
        yield server, home
    finally:
        server.stop()


@pytest.fixture(scope="session")
def mlflow_url(mlflow_server) -> str:
    server, home = mlflow_server
    wait_healthy(server, home / "server.log")
    return server.url


@pytest.fixture(scope="session")
def cluster():
    """Head (2 CPUs) + node2 (1 CPU): three logical CPUs on two raylets. A short root folder:
    Ray's socket paths must stay under 107 characters."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="hfc-"))
    c = LocalRayCluster(root)
    try:
        c.start_head(num_cpus=2)
        c.add_node("node2", num_cpus=1)
        yield c
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    from hybridflow.data import write_rows
    from hybridflow.data.tasks import make_arith

    d = tmp_path_factory.mktemp("cluster-data")
    write_rows(make_arith(6, difficulty=0, seed=11), str(d / "train.parquet"))
    write_rows(make_arith(3, difficulty=0, seed=12), str(d / "val.parquet"))
    (d / "varied_reward.py").write_text(VARIED_REWARD)
    return d


def train_cli(args: list[str], *, cwd: Path, log: Path, prefect_api: str) -> subprocess.Popen:
    """``hybridflow train -v ARGS`` in its own process group (the driver: attaches to the cluster)."""
    cwd.mkdir(parents=True, exist_ok=True)
    env = {**cluster_env(), "PREFECT_API_URL": prefect_api}
    env.pop("RAY_ADDRESS", None)
    return start_train(["-v", *args], cwd=cwd, log=log, env=env)


__all__ = ["REPO", "train_cli"]
