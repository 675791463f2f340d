"""Faults in full training runs on the tiny model (seeded, CPU): the run goes on, nothing is lost,
nothing is applied twice, and an interrupted run ends where an uninterrupted one does.

One reference run R (uninterrupted, in-process) is compared with:

- W: the same config, the policy actor SIGKILLed (by PID) inside iteration 2's rollout call and
  again inside iteration 4's policy update call — after the work, before the result returns (a
  test plugin holds those calls until the kill: tests/integration/hold_plugins.py);
- D: the same config run by ``hybridflow train`` in a subprocess (its own process group), SIGKILLed
  during iteration 4 once rollout and reward are done, then ``hybridflow train --resume RUN_DIR``.
  D's first process also shows determinism: an independent uninterrupted run (another process)
  that must match R bit for bit up to its last checkpoint; while it runs, a second start with the
  same ``trainer.run_id`` and a ``--resume`` of its folder are refused (one run per folder), and
  the resume after the SIGKILL takes the dead driver's stale lock over;
- F (other config): reward code that raises / returns NaN / hangs / crashes its process, and a
  policy loss that is NaN on chosen updates, until ``trainer.max_bad_updates`` stops the run.

Config of R/W/D: 6 prompts, 2 per step × 2 samples, 4 iterations (the 4th opens epoch 2),
checkpoints after iterations 3 and 4. Rewards come from a custom function whose scores vary
between samples, so every applied update moves the weights: a skipped or doubled update would
show in the final weights.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import tiny_overrides
from tests.train_process import kill_group, start_train
from workers import checkpoint as C
from workers.checkpoint import checkpoint_name

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]

ITERATIONS = 4
VARIED_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Deterministic and varied between samples (the tiny model never solves arithmetic)."""
    return (sum(map(ord, solution_str)) % 97) / 96.0
'''
# F: the first four rows scored in the whole run fail, one way each; markers make each happen once
FAULTY_REWARD = '''
import os, time
MARKERS = {markers!r}

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    for kind in ("raise", "nan", "hang", "crash"):
        try:
            os.close(os.open(os.path.join(MARKERS, kind), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            continue
        if kind == "raise":
            raise RuntimeError("reward code bug")
        if kind == "nan":
            return float("nan")
        if kind == "hang":
            time.sleep(600)
        os._exit(3)  # crash: the reward process dies
    return (sum(map(ord, solution_str)) % 97) / 96.0
'''


# ---- a policy loss that is NaN on chosen updates (F); trainer.plugins imports this module ------
NAN_UPDATES = {0, 2, 3}  # 0-based update index: iterations 1, 3 and 4
MICRO_BATCHES_PER_UPDATE = 2  # 4 trajectories, mini-batch 4, micro-batch 2, 1 epoch
_calls = [0]


def _register_nan_loss() -> None:
    from hybridflow.algorithms.registry import get_policy_loss, policy_loss_names, register_policy_loss

    if "nan_on_schedule" in policy_loss_names():
        return

    @register_policy_loss("nan_on_schedule")
    def nan_on_schedule(log_probs, old_log_probs, advantages, response_mask, **kwargs):
        loss, metrics = get_policy_loss("ppo")(log_probs, old_log_probs, advantages, response_mask, **kwargs)
        update = _calls[0] // MICRO_BATCHES_PER_UPDATE  # counts in the policy actor's process
        _calls[0] += 1
        return (loss * float("nan") if update in NAN_UPDATES else loss), metrics


_register_nan_loss()


# ---- helpers ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from hybridflow.data import write_rows
    from hybridflow.data.tasks import make_arith

    d = tmp_path_factory.mktemp("reliability-data")
    write_rows(make_arith(6, difficulty=0, seed=11), str(d / "train.parquet"))
    write_rows(make_arith(2, difficulty=0, seed=12), str(d / "val.parquet"))
    (d / "varied_reward.py").write_text(VARIED_REWARD)
    return d


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One runs folder (and one MLflow SQLite file) for every run of this module."""
    return tmp_path_factory.mktemp("reliability-runs")


def overrides(runs: Path, data: Path, run_id: str, **extra: str) -> list[str]:
    return tiny_overrides(str(runs), str(data / "train.parquet"), str(data / "val.parquet"), **{
        "trainer.run_id": run_id,
        "trainer.seed": "5",
        "trainer.total_iterations": str(ITERATIONS),
        "trainer.total_epochs": "2",
        "trainer.save_every": "3",
        "rollout.max_response_tokens": "12",
        "reward.function": f"{data / 'varied_reward.py'}:compute_score",
        "reward.timeout_s": "4",
        **extra,
    })


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def comparable_metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    """Last record per iteration (a resumed run may repeat one), without wall-clock metrics."""
    out = {}
    for rec in read_jsonl(run_dir / "metrics.jsonl"):
        out[rec["iteration"]] = {k: v for k, v in rec["metrics"].items()
                                 if not k.startswith("timing_s/") and not k.startswith("perf/throughput")
                                 and "mfu" not in k}
    return out


def policy_weights(step_dir: Path) -> dict[str, torch.Tensor]:
    from workers.checkpoint import read_safetensors_folder

    return read_safetensors_folder(step_dir / "policy")


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert different == [], f"{len(different)} tensors differ, e.g. {different[:3]}"


def executions(run_dir: Path) -> list[tuple[int, str]]:
    return [(e["iteration"], e["node"]) for e in read_jsonl(run_dir / "execution_log.jsonl")]


def assert_versions_step_by_one(run_dir: Path) -> None:
    """weights_version after iteration k is k (never skips, never repeats), and the ledger holds
    each applied update exactly once, in order."""
    metrics = comparable_metrics(run_dir)
    assert [metrics[i]["actor/weights_version"] for i in sorted(metrics)] == [1.0, 2.0, 3.0, 4.0]
    ledger = read_jsonl(run_dir / "updates_policy.jsonl")
    assert [(e["version_before"], e["iteration"]) for e in ledger] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    for step in (3, 4):
        state = json.loads((run_dir / "checkpoints" / checkpoint_name(step) / "trainer_state.json").read_text())
        assert state["policy_version"] == step


@pytest.fixture(scope="module")
def reference(prefect_api, ray_cluster, runs, data):
    """R: the uninterrupted run."""
    from flows.train import train

    summary = train(overrides=overrides(runs, data, "reference"))
    return Path(summary["run_dir"])


# ---- W: worker death ------------------------------------------------------------------------------
class ActorKiller(threading.Thread):
    """SIGKILLs the policy actor's process inside chosen calls: for each hold key (see
    ``tests/integration/hold_plugins.py``) it plants the marker, waits until the actor holds
    that call (its work done, its result not yet returned) and kills the PID it published."""

    def __init__(self, run_dir: Path, keys: list[str]):
        super().__init__(daemon=True)
        from tests.integration.hold_plugins import holds_dir

        self.holds, self.keys = holds_dir(run_dir), keys
        self.holds.mkdir(parents=True, exist_ok=True)
        for key in keys:
            (self.holds / key).touch()
        self.kills: list[dict] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for key in self.keys:
                held = self.holds / f"{key}.held"
                deadline = time.monotonic() + 900
                while not held.exists():
                    assert time.monotonic() < deadline, f"the policy actor never held {key}"
                    time.sleep(0.05)
                pid = int(held.read_text())
                os.kill(pid, signal.SIGKILL)
                self.kills.append({"key": key, "pid": pid})
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def test_worker_death_during_rollout_and_update(prefect_api, ray_cluster, runs, data, reference):
    from flows.train import train
    from workers.pool import read_pool_events

    run_dir = runs / "worker-death"
    # iteration 2's rollout runs at weights_version 1; iteration 4's update expects version 3
    killer = ActorKiller(run_dir, ["generate_sequences-v1", "update_policy-v3"])
    killer.start()
    summary = train(overrides=overrides(runs, data, "worker-death",
                                        **{"trainer.plugins": "[tests.integration.hold_plugins]"}))
    killer.join(timeout=600)
    assert killer.error is None, killer.error
    assert [k["key"] for k in killer.kills] == ["generate_sequences-v1", "update_policy-v3"]
    # Ray restarted the actor after each kill (three processes in all, each started once); the
    # first restart had no checkpoint to restore, the second restored the one after iteration 3
    starts = read_pool_events(str(run_dir), "main")
    assert [k["pid"] for k in killer.kills] == [s["pid"] for s in starts[:2]]
    assert len(starts) == 3 and len({s["pid"] for s in starts}) == 3, starts
    assert [s["restored_from"] for s in starts[:2]] == [None, None]
    assert starts[2]["restored_from"].endswith(f"checkpoints/{checkpoint_name(3)}")
    assert summary["iterations"] == ITERATIONS
    # the killed nodes ran again (Prefect task retries); nothing else did
    log = executions(run_dir)
    assert log.count((2, "rollout")) == 2 and log.count((4, "update_policy")) == 2
    assert log.count((2, "update_policy")) == 1 and log.count((4, "rollout")) == 1
    assert_versions_step_by_one(run_dir)
    assert comparable_metrics(run_dir) == comparable_metrics(reference)
    assert_same_weights(policy_weights(run_dir / "checkpoints" / checkpoint_name(4)),
                        policy_weights(reference / "checkpoints" / checkpoint_name(4)))


# ---- D: driver death -------------------------------------------------------------------------------
def _cli(args: list[str], log: Path) -> subprocess.Popen:
    return start_train(args, log=log)


def test_driver_death_then_resume(prefect_api, ray_cluster, runs, data, reference, tmp_path):
    import ray

    from workers.pool import PoolError, get_pool, namespace_for

    address = ray.get_runtime_context().gcs_address
    cfg_args = overrides(runs, data, "driver-death", **{"placement.ray_address": address})
    run_dir = runs / "driver-death"
    first = _cli(cfg_args, tmp_path / "first.log")
    second: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + 1200
        while (ITERATIONS, "advantage") not in executions(run_dir):  # rollout and reward are done
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "iteration 4 never reached advantage"
            if not second and (run_dir / "run.json").exists():  # the run is live: two more starts on its folder
                second = [_cli(cfg_args, tmp_path / "second.log"), _cli(["--resume", str(run_dir)], tmp_path / "again.log")]
            time.sleep(0.05)
        assert second and all(p.poll() is not None for p in second), "the refused starts outlived the run"
    finally:
        kill_group(first)
        for p in second:
            kill_group(p)
    # one run owns its folder: both were refused in one line, before starting any server
    for p, log in zip(second, ("second.log", "again.log"), strict=True):
        out = (tmp_path / log).read_text().strip()
        assert p.returncode == 2 and "Traceback" not in out and len(out.splitlines()) == 1, out
        assert f"is in use by another hybridflow run (pid {first.pid} on host" in out
    killed_at = time.time()
    assert first.returncode == -signal.SIGKILL
    # determinism: the killed process ran iterations 1-3 uninterrupted, in another process than R
    cut = comparable_metrics(run_dir)
    assert sorted(cut) == [1, 2, 3]
    assert cut == {i: comparable_metrics(reference)[i] for i in (1, 2, 3)}
    assert_same_weights(policy_weights(run_dir / "checkpoints" / checkpoint_name(3)),
                        policy_weights(reference / "checkpoints" / checkpoint_name(3)))
    # the killed driver's pools die with it (Ray kills a dead job's actors): nothing leaks
    deadline = time.monotonic() + 120
    while True:
        try:
            get_pool("main", namespace_for("driver-death"))
        except PoolError:
            break
        assert time.monotonic() < deadline, "the killed run's pool outlived its driver"
        time.sleep(1)

    resumed = _cli(["--resume", str(run_dir)], tmp_path / "resume.log")
    try:
        assert resumed.wait(timeout=1200) == 0, (tmp_path / "resume.log").read_text()[-3000:]
    finally:
        kill_group(resumed)
    after = [(e["iteration"], e["node"]) for e in read_jsonl(run_dir / "execution_log.jsonl") if e["t"] > killed_at]
    # from the last checkpoint (iteration 3) plus iteration 4's completed nodes: rollout and reward
    # come from the node cache; advantage only if it had not finished; the update always
    assert (ITERATIONS, "rollout") not in after and (ITERATIONS, "reward") not in after
    assert (ITERATIONS, "update_policy") in after and (ITERATIONS, "checkpoint") in after
    assert {i for i, _ in after} == {ITERATIONS}
    assert_versions_step_by_one(run_dir)
    assert comparable_metrics(run_dir) == comparable_metrics(reference)
    assert_same_weights(policy_weights(run_dir / "checkpoints" / checkpoint_name(4)),
                        policy_weights(reference / "checkpoints" / checkpoint_name(4)))
    # and the weights moved at all (a run that never updated would also "match")
    from hybridflow.config import load_config
    from hybridflow.models import load_causal_lm

    cfg = load_config(None, cfg_args)
    initial = load_causal_lm(cfg.model, seed=cfg.trainer.seed).state_dict()
    final = policy_weights(run_dir / "checkpoints" / checkpoint_name(4))
    assert any(not torch.equal(final[k], initial[k]) for k in final)


# ---- F: reward faults and numerical faults in one run ---------------------------------------------
def test_reward_and_numerical_faults(prefect_api, ray_cluster, runs, data, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from flows.train import TrainingStopped, train
    from hybridflow.config import load_config
    from hybridflow.models import load_causal_lm

    secrets = {"MLFLOW_TRACKING_PASSWORD": "pw-5e1d0", "PREFECT_API_KEY": "pnu_7b2c9"}
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    markers = tmp_path / "markers"
    markers.mkdir()
    reward = tmp_path / "faulty_reward.py"
    reward.write_text(FAULTY_REWARD.format(markers=str(markers)))
    ov = overrides(runs, data, "faults", **{
        "reward.function": f"{reward}:compute_score", "trainer.save_every": "1", "trainer.total_iterations": "6",
        "trainer.max_bad_updates": "2", "actor.policy_loss": "nan_on_schedule",
        "trainer.plugins": "[tests.integration.test_reliability_runs]",
    })
    with pytest.raises(TrainingStopped, match=r"2 policy updates in a row .*trainer\.max_bad_updates=2.*iteration 4"):
        train(overrides=ov)
    run_dir = runs / "faults"
    m = comparable_metrics(run_dir)
    assert sorted(m) == [1, 2, 3, 4]  # the stopping iteration is logged too
    # reward faults, scored reward.on_error=0 and counted: iteration 1's rows (one reward worker,
    # row by row) raise, return NaN and hang; the hang holds the batch to its one deadline, so the
    # 4th row, never started, times out with it; iteration 2's first row crashes its process
    expected = {"reward/errors": [1.0, 0.0, 0.0, 0.0], "reward/nan": [1.0, 0.0, 0.0, 0.0],
                "reward/timeouts": [2.0, 0.0, 0.0, 0.0], "reward/crashes": [0.0, 1.0, 0.0, 0.0]}
    for name, counts in expected.items():
        assert [m[i][name] for i in (1, 2, 3, 4)] == counts, name
    assert m[1]["critic/score/mean"] == 0.0
    # every group of iteration 1 has equal rewards (all 0): reported, not silently trained on
    assert m[1]["algorithm/zero_variance_groups"] == 1.0
    # NaN loss on updates 1, 3 and 4: skipped (weights_version unchanged), counted, stop at 2 in a row
    assert [m[i]["actor/update_skipped"] for i in (1, 2, 3, 4)] == [1.0, 0.0, 1.0, 1.0]
    assert [m[i]["actor/bad_updates"] for i in (1, 2, 3, 4)] == [1.0, 0.0, 1.0, 1.0]
    assert [m[i]["actor/weights_version"] for i in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]
    assert [m[i]["actor/bad_updates_in_a_row"] for i in (1, 2, 3, 4)] == [1.0, 0.0, 1.0, 2.0]
    ckpt = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpt.glob(f"{C.CHECKPOINT_PREFIX}*")) == [checkpoint_name(1), checkpoint_name(2), checkpoint_name(3)]
    versions = [json.loads((ckpt / checkpoint_name(i) / "trainer_state.json").read_text())["policy_version"]
                for i in (1, 2, 3)]
    assert versions == [0, 1, 1]
    cfg = load_config(None, ov)
    initial = {k: v for k, v in load_causal_lm(cfg.model, seed=cfg.trainer.seed).state_dict().items()}
    w1, w2, w3 = (policy_weights(ckpt / checkpoint_name(i)) for i in (1, 2, 3))
    assert_same_weights(w1, {k: initial[k] for k in w1})  # skipped: untouched
    assert any(not torch.equal(w2[k], w1[k]) for k in w1)  # applied: moved
    assert_same_weights(w3, w2)  # skipped: untouched
    # secrets in the environment never reach MLflow params
    client = MlflowClient(f"sqlite:///{runs}/mlflow.db")
    run_id = json.loads((run_dir / "run.json").read_text())["mlflow_run_id"]
    params = client.get_run(run_id).data.params
    assert params["trainer.max_bad_updates"] == "2"
    assert not [k for k, v in params.items() if any(s in v for s in secrets.values())]


def _listening_addresses(port: int) -> set[str]:
    """Local addresses with a socket LISTENing on ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for name in ("tcp", "tcp6"):
        path = Path(f"/proc/net/{name}")
        for line in path.read_text().splitlines()[1:] if path.exists() else []:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:
                raw = bytes.fromhex(addr)
                if name == "tcp":
                    found.add(".".join(str(b) for b in raw[::-1]))
                else:
                    words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
                    found.add(b"".join(words).hex())
    return found


def test_prefect_server_listens_on_localhost_only(prefect_api):
    """The server the product starts (flows.runtime.start_prefect_server, used by this session)."""
    port = int(prefect_api.rsplit(":", 1)[1].split("/")[0])
    assert _listening_addresses(port) == {"127.0.0.1"}
