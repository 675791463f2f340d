"""Multi-turn rollouts under ``trainer.async_mode: stream`` on a tiny model (issue 38): the
rollout pool generates whole groups of multi-turn trajectories (a user environment,
tests/unit/agent_fixtures.py GuessEnv) while the trainer trains, weights land between turns, the
trainer takes whole groups, and a resumed run (extended by one iteration) takes up the checkpointed
buffer with no group lost or trained twice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.conftest import tiny_overrides
from tests.integration.test_async_training import ROLLOUT_POOL

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]

G, N = 2, 2  # groups per iteration, samples per group


def _rows(run_dir: Path, it: int):
    from hybridflow.batch import Batch

    return Batch.load(str(run_dir / f"iter_{it:06d}" / "rollout"))


def _turn_versions(versions: list[int], model: list[bool]) -> list[set[int]]:
    """The versions of each model turn (a run of model tokens) of one trajectory."""
    turns: list[set[int]] = []
    prev = False
    for v, m in zip(versions, model, strict=True):
        if m and not prev:
            turns.append(set())
        if m:
            turns[-1].add(v)
        prev = m
    return turns


def test_multi_turn_groups_stream_and_a_resume_takes_up_the_buffer(prefect_api, ray_cluster, arith_files, tmp_path):
    from flows.train import train

    train_file, val_file = arith_files
    ov = tiny_overrides(str(tmp_path / "runs"), train_file, val_file, **ROLLOUT_POOL, **{
        "trainer.run_id": "stream-env", "trainer.async_mode": "stream", "trainer.max_staleness": "1",
        "trainer.total_iterations": "2", "trainer.save_every": "1",
        "rollout.environment": "tests.unit.agent_fixtures:GuessEnv", "rollout.max_response_tokens": "32",
        "rollout.multi_turn.max_turns": "3", "rollout.multi_turn.max_tokens_per_turn": "4",
        "rollout.partial": "abort"})
    summary = train(overrides=ov)
    assert summary["iterations"] == 2
    run_dir = Path(summary["run_dir"])
    summary = train(overrides=ov + ["trainer.total_iterations=3"], resume=str(run_dir))
    hist = {h["iteration"]: h["metrics"] for h in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert sorted(hist) == [1, 2, 3]
    trained: list[int] = []
    for it in (1, 2, 3):
        rows = _rows(run_dir, it)
        gids = rows["stream_gid"]
        assert len(rows) == G * N and all(gids.count(g) == N for g in set(gids))  # whole groups
        trained += sorted(set(gids))
        mask, obs, vers = rows["response_mask"], rows["observation_mask"], rows["rollout_token_versions"]
        assert vers.shape == mask.shape and not (mask & obs).any()
        assert rows["num_turns"] and all(1 <= t <= 3 for t in rows["num_turns"])
        for r in range(len(rows)):
            real = (mask[r] | obs[r])
            turns = _turn_versions(vers[r][real].tolist(), mask[r][real].tolist())
            assert all(len(t) == 1 for t in turns), turns  # a model turn is never cut by a weights load
            flat = [min(t) for t in turns]
            assert flat == sorted(flat)
            if flat:  # the row's version is its oldest model token's
                assert int(rows["rollout_version"][r]) == flat[0]
        assert hist[it]["rollout/staleness/max"] <= 1
        assert "multi_turn/num_turns/mean" in hist[it] and hist[it]["multi_turn/num_turns/max"] >= 1
    # a multi-turn trajectory really alternates model turns and observations
    assert any(bool(_rows(run_dir, it)["observation_mask"].any()) for it in (1, 2, 3))
    # exactly once across the resume: no group twice, none lost (trained or still recorded in flight)
    assert len(trained) == 3 * G and len(set(trained)) == len(trained), trained
    final = json.loads((run_dir / "checkpoints" / "iter_000003" / "trainer_state.json").read_text())
    stream = final["rollouts"]["stream"]
    pending = [e["gid"] for e in stream["inflight"] + stream["queue"]]
    assert sorted(trained + pending) == list(range(stream["next_gid"]))
