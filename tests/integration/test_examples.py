"""Every example config is a real run of the product: each trains one iteration end to end through
the train flow, pools and node tasks, with only the model swapped for the tiny random one and the
data for small generated files of the same task (the settings that define the algorithm — estimator,
critic, KL, clipping, aggregation, group filtering, overlong shaping — are the file's own)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.config import load_config
from tests.integration.conftest import release_run_pools, tiny_overrides

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def task_files(tmp_path_factory):
    """Small train/val files per task: arith, countdown, gsm8k (from a GSM8K-shaped jsonl), reasoning-gym,
    a TextArena game, the examples' verifiers environment."""
    from hybridflow.data import write_rows
    from hybridflow.data.tasks import gsm8k_rows, make_arith, make_countdown
    from hybridflow.data.tasks.reasoning_gym import make_reasoning_gym

    d = tmp_path_factory.mktemp("example-data")
    out = {}
    for name, rows in {"arith": make_arith(8, difficulty=0, seed=1),
                       "countdown": make_countdown(8, seed=1, max_number=9, max_target=20),
                       "reasoning_gym": make_reasoning_gym(["chain_sum"], 8, seed=1,
                                                           overrides={"chain_sum": {"max_terms": 2, "max_digits": 2}}),
                       }.items():  # fmt: skip
        write_rows(rows, str(d / f"{name}.parquet"))
        out[name] = str(d / f"{name}.parquet")
    from hybridflow.data.tasks.textarena import make_textarena

    # the rows name the game: TowerOfHanoi's opening fits the tiny model's 512 positions (GuessTheNumber's
    # is 527 tokens of its tokenizer); the example's settings are what is tested
    write_rows(make_textarena("TowerOfHanoi-v0", 4, seed=1), str(d / "textarena.parquet"))
    out["textarena"] = str(d / "textarena.parquet")
    from hybridflow.data.tasks.verifiers_rows import make_verifiers

    write_rows(make_verifiers(f"{EXAMPLES}/verifiers_arith_env.py:load_environment", env_args={"n": 8, "eval_n": 4},
                              n=8), str(d / "verifiers.parquet"))  # fmt: skip
    out["verifiers"] = str(d / "verifiers.parquet")
    raw = d / "gsm8k.jsonl"
    raw.write_text("".join(json.dumps({"question": f"Tom has {i} apples and buys 2 more. How many?",
                                       "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"}) + "\n" for i in range(8)))
    write_rows(gsm8k_rows(str(raw)), str(d / "gsm8k.parquet"))
    out["gsm8k"] = str(d / "gsm8k.parquet")
    return out


# example → (task data, metrics its algorithm must produce)
CASES = {
    "grpo_arith.yaml": ("arith", ["actor/pg_clipfrac", "algorithm/zero_variance_groups"]),
    "ppo_arith.yaml": ("arith", ["critic/vf_loss", "critic/values/mean", "actor/reward_kl_penalty"]),
    "rloo_arith.yaml": ("arith", ["actor/pg_loss"]),
    "reinforce_pp_arith.yaml": ("arith", ["actor/reward_kl_penalty"]),
    "dapo_countdown.yaml": ("countdown", ["filter_groups/kept_groups"]),
    "grpo_reasoning_gym.yaml": ("reasoning_gym", ["actor/pg_clipfrac", "reward/reasoning_gym/chain_sum/mean"]),
    "grpo_gsm8k.yaml": ("gsm8k", ["actor/kl_loss"]),
    "grpo_arith_async.yaml": ("arith", ["rollout/staleness/max", "rollout_corr/rollout_is_mean",
                                        "timing_s/weight_sync", "async/overlap_fraction"]),
    "grpo_textarena_guess.yaml": ("textarena", ["env/win_rate", "env/invalid_moves/mean", "multi_turn/num_turns/mean"]),
    "grpo_verifiers_arith.yaml": ("verifiers", ["multi_turn/num_turns/mean", "env/errors", "actor/pg_clipfrac"]),
    "grpo_arith_judge.yaml": ("arith", ["timing_s/judge", "judge/tokens_per_s", "reward/judge_unparsed",
                                        "reward/judge_overlong"]),
    "grpo_arith_tool.yaml": ("arith", ["multi_turn/num_turns/mean", "tool/calls/mean", "tool/parse_errors",
                                       "response_length/observation_tokens/mean"]),
}


# examples run by another suite: the vLLM one needs the vLLM runtime (make test-vllm)
COVERED_ELSEWHERE = {"grpo_arith_vllm.yaml": Path(__file__).resolve().parents[1] / "vllm" / "driver" / "test_train_vllm.py",
                     # the documented stream command trains it one iteration (and tests/vllm on vLLM)
                     "grpo_arith_stream.yaml": Path(__file__).resolve().parent / "test_cli_commands.py",
                     # trains with a local lm-eval task it writes first
                     "grpo_arith_lmeval.yaml": Path(__file__).resolve().parent / "test_harness_eval.py"}


def test_every_example_is_covered():
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted([*CASES, *COVERED_ELSEWHERE])
    for example, test_file in COVERED_ELSEWHERE.items():
        assert f"examples/{example}" in test_file.read_text(), f"{example} is not run by {test_file}"


@pytest.mark.parametrize("example", sorted(CASES))
def test_example_trains_one_iteration(prefect_api, ray_cluster, task_files, tmp_path, example):
    from flows.train import train

    task, expected = CASES[example]
    own = load_config(EXAMPLES / example)
    ov = tiny_overrides(str(tmp_path / "runs"), task_files[task], task_files[task], **{
        "trainer.run_id": example.removesuffix(".yaml").replace("_", "-"),
        "trainer.total_iterations": "1",
        "data.prompts_per_iteration": "2",
        "rollout.samples_per_prompt": "2",
        "rollout.max_response_tokens": "8",
    })
    if own.algorithm.overlong_buffer.enable:  # the ramp must fit in the 8 tokens
        ov.append("algorithm.overlong_buffer.buffer_tokens=4")
    if own.rollout.is_multi_turn:  # the per-turn budget must fit in the 8 tokens
        ov.append("rollout.multi_turn.max_tokens_per_turn=4")
    if own.needs_critic:
        ov.append("placement.pools.critic.cpus_per_worker=0.5")
    summary = train(config_path=str(EXAMPLES / example), overrides=ov)
    assert summary["iterations"] == 1
    run_dir = Path(summary["run_dir"])
    cfg = load_config(run_dir / "config.yaml")
    # the algorithm is the example's own, not a default (bar the overlong ramp shortened above)
    keep = {"overlong_buffer": {"buffer_tokens"}}
    assert cfg.algorithm.model_dump(exclude=keep) == own.algorithm.model_dump(exclude=keep)
    assert (cfg.actor.policy_loss, cfg.actor.loss_agg_mode, cfg.actor.clip_ratio_high, cfg.actor.use_kl_loss) == (
        own.actor.policy_loss, own.actor.loss_agg_mode, own.actor.clip_ratio_high, own.actor.use_kl_loss)
    metrics = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["metrics"]
    missing = [k for k in expected if k not in metrics]
    assert not missing, f"{example}: no {missing} in {sorted(metrics)}"
    assert metrics["actor/weights_version"] == 1.0 or metrics.get("actor/update_skipped") == 1.0


def test_reward_model_scores_in_the_reward_pool(prefect_api, ray_cluster, task_files, tmp_path):
    """A sequence-classification reward model (tiny, random) loaded by the reward pool's actor adds
    its score to the rule reward of every trajectory in a real iteration."""
    from flows.train import train

    ov = tiny_overrides(str(tmp_path / "runs"), task_files["arith"], task_files["arith"], **{
        "trainer.run_id": "reward-model", "trainer.total_iterations": "1",
        "reward.model.path": "tiny", "reward.model.combine": "add", "reward.model.weight": "0.5",
    })
    summary = train(overrides=ov)
    metrics = json.loads((Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()[0])["metrics"]
    rm, rule = metrics["reward/rm_score/mean"], metrics["reward/rule_score/mean"]
    assert metrics["reward/rm_score/min"] < metrics["reward/rm_score/max"]  # a real model: scores differ by text
    # the trajectory score is rule + 0.5·rm, averaged over the batch
    assert metrics["critic/score/mean"] == pytest.approx(rule + 0.5 * rm, abs=1e-5)


def test_judge_pool_scores_every_trajectory_and_its_unparsed_rows_never_stop_the_run(
        prefect_api, ray_cluster, task_files, tmp_path):  # fmt: skip
    """reward.judge on the tiny model in a judge pool of its own: its verdicts cannot parse (a
    <score></score> tag in 4 random tokens), so every row is scored reward.on_error and counted —
    and with reward.max_failure_iterations=1 the run still trains, since those are not reward failures.
    Each trajectory's score is the rule score + weight·on_error, in training and in validation."""
    from flows.train import train

    ov = tiny_overrides(str(tmp_path / "runs"), task_files["arith"], task_files["arith"], **{
        "trainer.run_id": "judge", "trainer.total_iterations": "1", "reward.max_failure_iterations": "1",
        "reward.judge.enable": "true", "reward.judge.verdict": "score_tag", "reward.judge.max_new_tokens": "4",
        "reward.judge.weight": "2", "reward.on_error": "-0.5", "trainer.val_before_train": "true",
        "placement.pools.judge": "{workers: 1, cpus_per_worker: 0.5, roles: [judge]}",
    })  # fmt: skip
    summary = train(overrides=ov)
    assert summary["iterations"] == 1
    metrics = json.loads((Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()[0])["metrics"]
    assert metrics["reward/judge_unparsed"] == 4.0 and metrics["reward/judge_overlong"] == 0.0  # 2 prompts × 2
    assert metrics["timing_s/judge"] > 0 and metrics["judge/tokens_per_s"] > 0
    assert "reward/judge_rule_agreement" not in metrics  # no row has a judge score to agree with
    # rule score = acc (format_weight 0); final = acc + 2·(-0.5)
    assert metrics["critic/score/mean"] == pytest.approx(metrics["reward/arith/acc/mean"] - 1.0, abs=1e-6)
    # validation scores with the judge too: 8 validation prompts, one greedy sample each
    val = json.loads((Path(summary["run_dir"]) / "validation.jsonl").read_text().splitlines()[0])["metrics"]
    assert val["val-aux/judge_unparsed"] == 8.0 and val["val-aux/judge/tokens_per_s"] > 0
    assert val["val-aux/score/mean"] == pytest.approx(val["val-core/arith/acc/mean@1"] - 1.0, abs=1e-6)
    # `hybridflow eval` of the checkpoint keeps the judge pool: the same judged validation, in its own pools
    from flows.cli import main
    from hybridflow.config import load_config as load

    run_dir = Path(summary["run_dir"])
    release_run_pools("judge", load(run_dir / "config.yaml"))
    assert main(["eval", "--model", str(run_dir), "--step", "1", "--data", task_files["arith"]]) == 0
    (eval_json,) = run_dir.glob("evals/*/eval.json")
    judged = json.loads(eval_json.read_text())["metrics"]
    assert judged["val-aux/judge_unparsed"] == 8.0 and judged["val-aux/judge/tokens_per_s"] > 0
    assert judged["val-aux/score/mean"] == pytest.approx(judged["val-core/arith/acc/mean@1"] - 1.0, abs=1e-6)


def test_environment_config_trains_one_iteration(prefect_api, ray_cluster, task_files, tmp_path):
    """rollout.environment: a user environment class (tests/unit/agent_fixtures.py) steps every
    trajectory in the policy pool; its rewards are the trajectory scores (reward.combine=replace)."""
    from flows.train import train

    ov = tiny_overrides(str(tmp_path / "runs"), task_files["arith"], task_files["arith"], **{
        "trainer.run_id": "environment", "trainer.total_iterations": "1",
        "rollout.environment": "tests.unit.agent_fixtures:GuessEnv", "rollout.max_response_tokens": "48",
        "rollout.multi_turn.max_turns": "2", "rollout.multi_turn.max_tokens_per_turn": "4",
    })
    summary = train(overrides=ov)
    assert summary["iterations"] == 1
    metrics = json.loads((Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()[0])["metrics"]
    assert metrics["multi_turn/num_turns/max"] == 2 and metrics["response_length/observation_tokens/mean"] > 0
    # GuessEnv gives -0.1 per wrong guess and +1 for the target 7: random tiny-model text scores in [-0.2, 1]
    assert -0.2 - 1e-6 <= metrics["critic/score/mean"] <= 1.0 and metrics["critic/score/mean"] != 0
    assert metrics["actor/weights_version"] == 1.0 or metrics.get("actor/update_skipped") == 1.0


def test_a_textarena_game_trains_one_iteration(prefect_api, ray_cluster, tmp_path):
    """`hybridflow data textarena` rows with rollout.environment=textarena: every trajectory plays
    its row's game in the environment workers (no env_error), the game metrics are logged, and each
    score is the game's reward (TowerOfHanoi: the share of disks moved, in [0, 1])."""
    from flows.train import train
    from hybridflow.data import write_rows
    from hybridflow.data.tasks.textarena import make_textarena

    games = str(tmp_path / "hanoi.parquet")
    write_rows(make_textarena("TowerOfHanoi-v0", 4, seed=1), games)  # its opening fits the tiny model
    ov = tiny_overrides(str(tmp_path / "runs"), games, games, **{
        "trainer.run_id": "textarena", "trainer.total_iterations": "1",
        "rollout.environment": "textarena", "rollout.max_response_tokens": "48",
        "rollout.multi_turn.max_turns": "3", "rollout.multi_turn.max_tokens_per_turn": "6",
    })
    summary = train(overrides=ov)
    metrics = json.loads((Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()[0])["metrics"]
    assert metrics["env/errors"] == 0 and metrics["multi_turn/num_turns/max"] >= 1
    assert 0.0 <= metrics["env/win_rate"] <= 1.0 and metrics["env/invalid_moves/mean"] >= 0.0
    assert 0.0 <= metrics["critic/score/min"] <= metrics["critic/score/max"] <= 1.0
    ended = metrics["multi_turn/finish/env_done"] + metrics["multi_turn/finish/max_turns"] + metrics["multi_turn/finish/length"]
    assert ended == pytest.approx(1.0)


def test_an_openenv_environment_trains_one_iteration(prefect_api, ray_cluster, tmp_path):
    """rollout.environment=openenv on rows naming an OpenEnv environment (tests/unit/agent_fixtures.py
    CountUpEnv, built on openenv-core's Environment / Action / Observation, run in-process): every
    trajectory plays its row's episode in the environment workers (no env_error), the invalid moves are
    counted, and each score is the episode's summed reward (CountUpEnv: 0.25 a right number, 1 the last,
    -0.5 a wrong one; a text that is not digits is an invalid move worth 0: in [-0.5, 1.5])."""
    from flows.train import train
    from hybridflow.agents.hub_openenv import OpenEnvEnvironment
    from hybridflow.data import write_rows

    rows = []
    for i in range(4):
        kwargs = {"env": "tests.unit.openenv_fixtures:CountUpEnv", "action": "tests.unit.openenv_fixtures:CountAction",
                  "seed": i, "instructions": "Reply with the next number only."}  # fmt: skip
        rows.append({"data_source": "openenv/CountUp", "prompt": OpenEnvEnvironment(**kwargs).reset({}),
                     "ability": "game", "reward_model": {"style": "environment", "ground_truth": f"seed {i}"},
                     "extra_info": {"index": i, "agent_name": "openenv", "env_kwargs": kwargs}})  # fmt: skip
    episodes = str(tmp_path / "count_up.parquet")
    write_rows(rows, episodes)
    ov = tiny_overrides(str(tmp_path / "runs"), episodes, episodes, **{
        "trainer.run_id": "openenv", "trainer.total_iterations": "1",
        "rollout.environment": "openenv", "rollout.max_response_tokens": "48",
        "rollout.multi_turn.max_turns": "3", "rollout.multi_turn.max_tokens_per_turn": "6",
    })
    summary = train(overrides=ov)
    metrics = json.loads((Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()[0])["metrics"]
    assert metrics["env/errors"] == 0 and metrics["multi_turn/num_turns/max"] >= 1
    assert metrics["env/invalid_moves/mean"] >= 0.0 and "env/win_rate" not in metrics  # CountUpEnv reports no "won"
    assert -0.5 <= metrics["critic/score/min"] <= metrics["critic/score/max"] <= 1.5
    ended = metrics["multi_turn/finish/env_done"] + metrics["multi_turn/finish/max_turns"] + metrics["multi_turn/finish/length"]
    assert ended == pytest.approx(1.0)
    assert metrics["actor/weights_version"] == 1.0 or metrics.get("actor/update_skipped") == 1.0


def test_tools_pool_steps_the_environments_and_changes_nothing_else(prefect_api, ray_cluster, tmp_path):
    """placement.pools.tools {roles: [tools]}: every environment step of a real iteration runs in a
    process of the tools pool's rank (its parent pid is the rank's, from pool_events.jsonl), not of the
    policy pool; the same seed without the tools pool gives the same rollout, token for token."""
    from flows.train import train
    from hybridflow.batch import Batch
    from hybridflow.data import write_rows
    from hybridflow.data.tasks import make_arith

    def run(name: str, tools_pool: bool) -> tuple[Path, list[list[int]]]:
        log = tmp_path / f"{name}.pids"
        rows = make_arith(4, difficulty=0, seed=1)
        for r in rows:
            r["extra_info"]["env_kwargs"] = {"log": str(log)}
        write_rows(rows, str(tmp_path / f"{name}.parquet"))
        extra = {"placement.pools.tools": "{workers: 1, cpus_per_worker: 0.5, roles: [tools]}"} if tools_pool else {}
        ov = tiny_overrides(str(tmp_path / "runs"), str(tmp_path / f"{name}.parquet"), str(tmp_path / f"{name}.parquet"),
                            **{"trainer.run_id": name, "trainer.total_iterations": "1",
                               "rollout.environment": "tests.unit.agent_fixtures:PidLogEnv",
                               "rollout.max_response_tokens": "48", "rollout.multi_turn.max_turns": "2",
                               "rollout.multi_turn.max_tokens_per_turn": "4", **extra})  # fmt: skip
        summary = train(overrides=ov)
        run_dir = Path(summary["run_dir"])
        pids = [[int(x) for x in line.split()] for line in log.read_text().splitlines()]
        return run_dir, pids

    pooled_dir, pooled = run("tools-pool", True)
    events = [json.loads(line) for line in (pooled_dir / "pool_events.jsonl").read_text().splitlines()]
    started = {e["pool"]: e["pid"] for e in events if e["event"] == "started"}
    assert set(started) == {"main", "reward", "tools"}
    assert len(pooled) == 8  # 2 prompts × 2 samples, a step after each of their 2 turns (max_turns)
    assert {parent for _pid, parent in pooled} == {started["tools"]}  # the tools rank's process pool ran them
    metrics = json.loads((pooled_dir / "metrics.jsonl").read_text().splitlines()[0])["metrics"]
    assert metrics["multi_turn/num_turns/max"] == 2 and metrics["env/errors"] == 0
    local_dir, local = run("in-process", False)
    events = [json.loads(line) for line in (local_dir / "pool_events.jsonl").read_text().splitlines()]
    main_pid = next(e["pid"] for e in events if e["event"] == "started" and e["pool"] == "main")
    assert {parent for _pid, parent in local} == {main_pid}  # without the pool: the policy's own processes
    a, b = (Batch.load(str(d / "iter_000001" / "rollout")) for d in (pooled_dir, local_dir))
    assert a["response_ids"].tolist() == b["response_ids"].tolist()
    assert a["response_mask"].tolist() == b["response_mask"].tolist()
