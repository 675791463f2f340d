"""Every command of the README's quick reference, docs/cli.md and docs/async.md, run as written on a tiny model.

The commands run in a scratch folder laid out like a clone after ``make data``: ``examples/`` (the
repository's), ``data/arith/{train,test}.parquet`` and ``data/arith_test.parquet`` (a few generated
rows), so relative paths such as ``-c examples/grpo_arith.yaml`` and ``runs/grpo-arith`` mean what
the docs say. What differs from the docs is only the size: the demo model becomes ``tiny`` and the
appended overrides of :data:`TINY_TRAIN` / :data:`TINY_EVAL` shrink the run; ``<run_id>`` is
``grpo-arith``, checkpoint step 20 (or 10) and iteration 7 are step / iteration 1 (the run has one).
One training run (``runs/grpo-arith``) serves every eval, export and node command. Commands run
in this process through ``flows.cli.main`` against the session's Prefect server and Ray, except
``node run reward``, which runs the installed ``hybridflow`` script in a subprocess (its
``reward.function=my_reward.py:...`` is relative to the command's folder, which the session's
Ray workers do not share).

``test_every_documented_command_is_run_here`` fails when the docs gain a command this file does
not run.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flows.cli import main
from tests.unit.test_observe_units import _documented_commands

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[2]
RUN = "grpo-arith"
# the documented values that name the demo's size, and what the tiny run has instead
SUBSTITUTE = {"<run_id>": RUN, "smollm2-135m-instruct": "tiny", "--step 20": "--step 1", "--step 10": "--step 1",
              "iter_000020": "iter_000001", "--iteration 7": "--iteration 1"}
TINY_EVAL = ["rollout.max_response_tokens=6", "placement.pools.main.cpus_per_worker=0.5",
             "placement.pools.reward.cpus_per_worker=0.25", "trainer.device=cpu"]
TINY_TRAIN = ["model.path=tiny", "data.prompts_per_iteration=2", "data.max_prompt_tokens=448",
              "rollout.samples_per_prompt=2", "actor.mini_batch_trajectories=4", "actor.micro_batch_trajectories=2",
              "trainer.total_iterations=1", "trainer.save_every=1", "trainer.val_every=0",
              "trainer.val_before_train=false", *TINY_EVAL,
              "tracking.log_model=none", "tracking.system_metrics=false"]

CUSTOM_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Not a real reward: a quarter per character of the ground truth, so the test knows the score."""
    return 0.25 * len(str(ground_truth))
'''


def _out(label: str, samples: int = 1, where: str = f"runs/{RUN}/evals/eval-") -> list[str]:
    """What an eval prints: its table's title and column, and where the scored generations went."""
    return [f"{label}: {samples} sample(s) per prompt", f"mean@{samples}", f"/{where}"]


# documented command -> (what is appended to it, lines its output must hold, a file it must leave)
COMMANDS: dict[str, tuple[list[str], list[str], str | None]] = {
    "hybridflow config show -c examples/grpo_arith.yaml actor.lr=3e-6": ([], ["lr: 3.0e-06"], None),
    "hybridflow data arith --n 2000 --difficulty 2 --out data/arith2/train.parquet  --test-out "
    "data/arith2/test.parquet --test-n 200": ([], ["wrote 2000 arith rows to data/arith2/train.parquet"],
                                               "data/arith2/test.parquet"),
    "hybridflow train -c examples/grpo_arith.yaml trainer.total_iterations=20":
        ([*TINY_TRAIN, f"trainer.run_id={RUN}"], ["hybridflow run summary", "Open the UIs on this run:"],
         f"runs/{RUN}/checkpoints/iter_000001/trainer_state.json"),
    "hybridflow train -c examples/grpo_arith.yaml -v":
        ([*TINY_TRAIN, f"trainer.run_id={RUN}-v"], ["hybridflow run summary"], f"runs/{RUN}-v/summary.json"),
    # the run above finished: a resume of it says so and how to extend it, starting nothing (issue 40)
    "hybridflow train --resume runs/<run_id>": ([], ["already finished", "trainer.total_iterations=2"], None),
    "hybridflow export runs/<run_id> --step 10 out/model":
        ([], [f"exported step 1 of {RUN} (weights_version 1) to out/model"], "out/model/hybridflow_export.json"),
    "hybridflow export runs/grpo-arith --step 20 out/grpo-arith-20":
        ([], [f"exported step 1 of {RUN}"], "out/grpo-arith-20/config.json"),
    "hybridflow export runs/grpo-arith out/latest": ([], [f"exported step 1 of {RUN}"], "out/latest/config.json"),
    "hybridflow export runs/grpo-arith out/latest --register grpo-arith":
        ([], ["registered MLflow model 'grpo-arith' version 1"], "out/latest/config.json"),
    "hybridflow export runs/<run_id> out/latest --register my-policy":
        ([], ["registered MLflow model 'my-policy' version 1"], "out/latest/config.json"),
    "hybridflow eval --model runs/<run_id>/checkpoints/latest -c examples/grpo_arith.yaml":
        (TINY_EVAL, _out(f"{RUN}@step1"), None),
    "hybridflow eval --model smollm2-135m-instruct -c examples/grpo_arith.yaml": (TINY_EVAL, _out("tiny", where="runs/evals/eval-"), None),
    "hybridflow eval --model runs/grpo-arith": ([], _out(f"{RUN}@step1"), None),
    "hybridflow eval --model runs/grpo-arith --step 20 --samples 8 --temperature 1.0":
        ([], [*_out(f"{RUN}@step1", 8), "pass@8"], None),
    "hybridflow eval --model runs/grpo-arith/checkpoints/iter_000020 --data data/arith_test.parquet":
        ([], _out(f"{RUN}@step1"), None),
    "hybridflow eval --model out/model -c examples/grpo_arith.yaml --max-prompts 200":
        (TINY_EVAL, _out("model", where="runs/evals/eval-"), None),
    "hybridflow node run reward --run runs/grpo-arith --iteration 7 reward.function=my_reward.py:compute_score":
        ([], ["reward.debug on iteration 1", "critic/score/mean", "reward.debug.safetensors (+ .json), 4 rows"],
         f"runs/{RUN}/iter_000001/reward.debug.safetensors"),
    "hybridflow node run advantage --run runs/grpo-arith --iteration 7 algorithm.norm_adv_by_std_in_grpo=false":
        ([], ["advantage.debug on iteration 1", "advantage.debug.safetensors (+ .json), 4 rows"],
         f"runs/{RUN}/iter_000001/advantage.debug.safetensors"),
    "hybridflow node run advantage --run runs/grpo-arith --iteration 7 --use-debug-inputs":
        ([], ["advantage.debug on iteration 1"], None),
    "hybridflow dataflow show -c examples/grpo_arith.yaml":
        ([], ["calls policy @ pool main", "advantage(rollout <- rollout, reward <- reward"], None),
    "hybridflow dataflow show -c examples/grpo_arith.yaml algorithm.filter_groups=true":
        ([], ["advantage(rollout <- filter_groups, reward <- filter_groups"], None),
    "hybridflow train -c examples/grpo_arith_async.yaml":
        ([*TINY_TRAIN, f"trainer.run_id={RUN}-async"], ["hybridflow run summary"], f"runs/{RUN}-async/summary.json"),
    "hybridflow train -c examples/grpo_arith_stream.yaml":
        ([*TINY_TRAIN, f"trainer.run_id={RUN}-stream"], ["hybridflow run summary"], f"runs/{RUN}-stream/summary.json"),
    "hybridflow dataflow show -c examples/grpo_arith_async.yaml":
        ([], ["generate_ahead(prompts, policy_version) -> rollout  calls rollout @ pool gen",
              "old_log_probs(rollout <- rollout", "advantage(rollout <- old_log_probs"], None),
    "hybridflow bench list": ([], ["e2e", "peak"], None),
    "hybridflow bench peak --help": ([], ["usage:", "--tokens"], None),
}
SUBPROCESS = {"hybridflow node run reward"}  # commands run by the installed script (see the module docstring)
BEFORE = {"out/latest": "rm"}  # alternatives in the docs that write the same folder: each starts without it


def test_every_documented_command_is_run_here():
    documented = set(_documented_commands())
    assert documented <= set(COMMANDS), sorted(documented - set(COMMANDS))


def _argv(command: str, extra: list[str]) -> list[str]:
    for old, new in SUBSTITUTE.items():
        command = command.replace(old, new)
    return shlex.split(command)[1:] + extra


def _release_pools(run_dir: Path) -> None:
    """The train flow may leave its pools up: free their CPUs for the commands that follow."""
    from hybridflow.config import load_config
    from workers.pool import PoolError, destroy_pool, get_pool, namespace_for

    for name in load_config(run_dir / "config.yaml").placement.pools:
        try:
            destroy_pool(get_pool(name, namespace_for(run_dir.name)))
        except PoolError:
            pass


def _run_in_process(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's --help
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _run_script(argv: list[str], cwd: Path) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("RAY_ADDRESS", None)
    script = Path(sys.executable).with_name("hybridflow")
    proc = subprocess.run([str(script), *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture()
def workdir(tmp_path, monkeypatch, prefect_api):
    from hybridflow.data import write_rows
    from hybridflow.data.tasks import make_arith

    (tmp_path / "examples").symlink_to(ROOT / "examples")
    write_rows(make_arith(12, difficulty=0, seed=1), str(tmp_path / "data" / "arith" / "train.parquet"))
    write_rows(make_arith(4, difficulty=0, seed=2), str(tmp_path / "data" / "arith" / "test.parquet"))
    write_rows(make_arith(3, difficulty=0, seed=3), str(tmp_path / "data" / "arith_test.parquet"))
    (tmp_path / "my_reward.py").write_text(CUSTOM_REWARD)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the default: mlflow.db in the working directory
    monkeypatch.setenv("COLUMNS", "240")  # rich folds long paths at 80 columns; the checks read them whole
    return tmp_path


def test_documented_commands_run_as_written(workdir, ray_cluster, capsys):
    failures = []
    for command, (extra, lines, leaves) in COMMANDS.items():
        for path, action in BEFORE.items():
            if path in command and action == "rm":
                shutil.rmtree(workdir / path, ignore_errors=True)
        argv = _argv(command, extra)
        if any(command.startswith(s) for s in SUBPROCESS):
            code, out = _run_script(argv, workdir)
        else:
            code, out = _run_in_process(argv, capsys)
        if argv[0] == "train" and code == 0:
            run_ids = [a.split("=", 1)[1] for a in argv if a.startswith("trainer.run_id=")]
            _release_pools(workdir / "runs" / (run_ids[-1] if run_ids else RUN))
        missing = [line for line in lines if line not in out]
        if code != 0 or missing or (leaves and not (workdir / leaves).exists()):
            failures.append(f"{command}\n  argv {argv}\n  exit {code}, missing {missing}, leaves {leaves}\n"
                            f"{out[-2500:]}")
    assert not failures, "\n\n".join(failures)
    # the resume as written continued the run (its summary again), it did not start another
    assert json.loads((workdir / "runs" / RUN / "summary.json").read_text())["iterations"] == 1
    assert sorted(p.name for p in (workdir / "runs").iterdir() if (p / "run.json").is_file()) == [
        RUN, f"{RUN}-async", f"{RUN}-stream", f"{RUN}-v"]
