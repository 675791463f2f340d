"""Streaming asynchronous training end to end on a tiny model (issue 38, docs/async.md
"Streaming"): the rollout pool generates groups continuously, weights land between chunks
(partial rollouts, each token with its version), the trainer takes whole groups, and a driver
killed mid-run resumes with no group lost and none trained twice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import tiny_overrides
from tests.integration.test_async_training import ROLLOUT_POOL, killed_then_resumed
from tests.integration.test_reliability_runs import VARIED_REWARD

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]

ITERATIONS = 4
G = 2  # groups per iteration (data.prompts_per_iteration)


@pytest.fixture(scope="module")
def varied_reward(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("stream-reward") / "varied_reward.py"
    path.write_text(VARIED_REWARD)
    return f"{path}:compute_score"


def _stream(root: Path, arith_files, run_id: str, reward: str, **extra: str) -> list[str]:
    train_file, val_file = arith_files
    return tiny_overrides(str(root / "runs"), train_file, val_file, **ROLLOUT_POOL, **{
        "trainer.run_id": run_id, "actor.old_log_probs": "recompute", "actor.rollout_correction": "tis",
        "trainer.async_mode": "stream", "trainer.max_staleness": "1", "trainer.total_iterations": str(ITERATIONS),
        "trainer.save_every": "2", "rollout.max_response_tokens": "12", "rollout.partial_chunk_tokens": "3",
        "reward.function": reward, **extra})


def _rollout(run_dir: Path, it: int):
    from hybridflow.batch import Batch

    return Batch.load(str(run_dir / f"iter_{it:06d}" / "rollout"))


def _history(run_dir: Path) -> dict[int, dict]:
    return {h["iteration"]: h["metrics"] for h in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def submission(prefect_api, ray_cluster, arith_files, varied_reward, tmp_path_factory) -> dict:
    """An uninterrupted streaming run in submission order (its schedule makes partial rollouts
    happen whatever the timing), with LoRA adapters at lr 1e-2 (one run serves both tests below)."""
    from flows.train import train

    return train(overrides=_stream(tmp_path_factory.mktemp("stream-sub"), arith_files, "stream-sub", varied_reward,
                                   **{"trainer.stream_order": "submission", "model.lora_rank": "4",
                                      "actor.lr": "1e-2"}))


def test_groups_are_taken_whole_once_each_and_tokens_carry_their_versions(submission):
    from tasks.versions import read_ledger

    run_dir = Path(submission["run_dir"])
    assert submission["iterations"] == ITERATIONS
    ledger = read_ledger(str(run_dir), "policy")
    hist = _history(run_dir)
    seen: list[int] = []
    mixed_rows = 0
    for it in range(1, ITERATIONS + 1):
        rows = _rollout(run_dir, it)
        gids = rows["stream_gid"]
        assert len(rows) == G * 2 and gids == sorted(gids)  # two samples per group, groups whole
        groups = sorted(set(gids))
        assert groups == list(range((it - 1) * G, it * G))  # submission order: cohort it
        seen += groups
        vers, mask = rows["rollout_token_versions"], rows["response_mask"]
        assert vers.dtype == torch.int64 and vers.shape == mask.shape
        trained_at = ledger[it - 1]["version_before"]
        # the schedule: cohort j's chunk c uses version min(j-1, max(0, j-2) + c)
        for r in range(len(rows)):
            v = vers[r][mask[r]].tolist()
            expected = [min(it - 1, max(0, it - 2) + c // 3) for c in range(len(v))]
            assert v == expected, (it, r, v)
            mixed_rows += len(set(v)) > 1
            assert rows["rollout_version"][r] == min(v)
            assert 0 <= trained_at - min(v) <= 1  # the staleness bound, per token
        assert hist[it]["rollout/staleness/max"] <= 1
        assert hist[it]["rollout/dropped_stale"] == 0
    assert mixed_rows > 0  # partial rollouts: responses continued under new weights
    assert len(seen) == len(set(seen))
    # the take is a Prefect task run of the train flow, one per iteration
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter

    with get_client(sync_client=True) as client:
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [submission["prefect_flow_run_id"]]}))
    assert {f"take_groups-{it:06d}" for it in range(1, ITERATIONS + 1)} <= {t.name for t in tasks}
    state = json.loads((run_dir / "checkpoints" / "iter_000002" / "trainer_state.json").read_text())
    stream = state["rollouts"]["stream"]
    assert [e["gid"] for e in stream["inflight"]] == [4, 5] and stream["next_gid"] == 6


def test_completion_order_run_trains_and_a_killed_driver_resumes_exactly_once(arith_files, varied_reward, tmp_path,
                                                                            prefect_api, ray_cluster):
    import ray

    args = _stream(tmp_path, arith_files, "stream-killed", varied_reward,
                   **{"placement.ray_address": ray.get_runtime_context().gcs_address,
                      "actor.max_token_staleness": "1"})
    run_dir = tmp_path / "runs" / "stream-killed"
    killed_then_resumed(args, run_dir, tmp_path, (3, "old_log_probs"))
    trained: list[int] = []
    uids: list[str] = []
    for it in range(1, ITERATIONS + 1):
        rows = _rollout(run_dir, it)
        trained += sorted(set(rows["stream_gid"]))
        uids += sorted(set(rows["uid"]))
    assert len(trained) == ITERATIONS * G and len(set(trained)) == len(trained), trained  # none twice
    assert len(set(uids)) == len(uids)  # no prompt trained twice either
    # none lost: every group drawn before the end was trained or is still recorded in flight
    final = json.loads((run_dir / "checkpoints" / f"iter_{ITERATIONS:06d}" / "trainer_state.json").read_text())
    stream = final["rollouts"]["stream"]
    pending = [e["gid"] for e in stream["inflight"] + stream["queue"]]
    assert sorted(trained + pending) == list(range(stream["next_gid"]))
    hist = _history(run_dir)
    assert all("rollout_corr/stale_token_fraction" in hist[it] for it in hist)
    assert all(hist[it]["rollout/staleness/max"] <= 1 for it in hist)
    assert all(0.0 <= hist[it]["trainer/idle_ratio"] <= 1.0 for it in hist)
    # the hf engine decodes a response in one call until newer weights arrive, interrupted only at a
    # chunk boundary (rollout.partial_chunk_tokens=3): a row's version changes at multiples of 3
    for it in range(1, ITERATIONS + 1):
        rows = _rollout(run_dir, it)
        vers, mask = rows["rollout_token_versions"], rows["response_mask"]
        for r in range(len(rows)):
            v = vers[r][mask[r]].tolist()
            assert v == sorted(v) and all(i % 3 == 0 for i in range(1, len(v)) if v[i] != v[i - 1]), (it, r, v)


def _fresh_token_gap(run_dir: Path, it: int, version: int) -> tuple[float, float]:
    """(max |rollout_log_probs − old_log_probs| over the tokens of iteration ``it`` sampled with
    ``version`` — the weights the update starts from, which old_log_probs recomputes —, the same
    over the older tokens)."""
    from hybridflow.batch import Batch

    rows = Batch.load(str(run_dir / f"iter_{it:06d}" / "old_log_probs"))
    mask, vers = rows["response_mask"], rows["rollout_token_versions"]
    gap = (rows["rollout_log_probs"] - rows["old_log_probs"]).abs()
    fresh, old = mask & (vers == version), mask & (vers < version)
    assert fresh.any() and old.any(), "the run has no partial rollout to compare"
    return float(gap[fresh].max()), float(gap[old].max())


def test_lora_adapters_reach_the_streaming_rollout_pool(submission):
    """verl #7495 (async + LoRA never syncing the adapter), for the stream: with lr 1e-2 the adapter
    moves, so tokens the rollout pool labels with the trainer's current version carry that
    version's log-probs only if the adapter really arrived; older tokens are far from them."""
    from tasks.versions import read_ledger

    run_dir = Path(submission["run_dir"])
    ledger = read_ledger(str(run_dir), "policy")
    for it in range(2, ITERATIONS + 1):
        fresh, old = _fresh_token_gap(run_dir, it, ledger[it - 1]["version_before"])
        assert fresh < 1e-3 < old, (it, fresh, old)
    synced = [m["perf/weight_sync_bytes"] for m in _history(run_dir).values()]
    assert 0 < max(synced) < 99_968 / 5  # the adapters (7 KB), not the model (100 KB in float32)


# a group of a prompt with an even answer scores alike (all 0); odd answers vary
HALF_FLAT_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if int(ground_truth) % 2 == 0:
        return 0.0
    return (sum(map(ord, solution_str)) % 97) / 96.0
'''


def test_filter_groups_refills_the_stream_with_groups_that_vary(prefect_api, ray_cluster, arith_files, tmp_path):
    """DAPO dynamic sampling under the stream refills the batch (verl V1's ReplayBufferAsync) instead
    of shrinking it: a zero-variance group is replaced by a spare prompt's group; every iteration
    trains on prompts_per_iteration groups that vary, and no group is both trained and filtered."""
    from flows.train import train
    from hybridflow.batch import Batch

    reward = tmp_path / "half_flat.py"
    reward.write_text(HALF_FLAT_REWARD)
    summary = train(overrides=_stream(tmp_path, arith_files, "stream-filter", f"{reward}:compute_score", **{
        "algorithm.filter_groups": "true", "trainer.total_iterations": "2"}))
    run_dir = Path(summary["run_dir"])
    hist = _history(run_dir)
    assert sum(m["stream/filtered_groups"] for m in hist.values()) > 0  # some groups were replaced
    trained: list[int] = []
    for it in (1, 2):
        rows = _rollout(run_dir, it)
        scores = Batch.load(str(run_dir / f"iter_{it:06d}" / "reward"))["token_level_scores"].sum(-1)
        gids = rows["stream_gid"]
        assert len(set(gids)) == G  # the batch kept its size
        for g in set(gids):
            s = scores[[i for i, x in enumerate(gids) if x == g]]
            if hist[it]["stream/zero_variance_taken"] == 0:
                assert float(s.max() - s.min()) > 0, (it, g)
        assert hist[it]["filter_groups/dropped_groups"] == hist[it]["stream/zero_variance_taken"]
        trained += sorted(set(gids))
    assert len(trained) == len(set(trained))


def test_pause_in_place_on_the_hf_engine_trains_with_tokens_versioned_at_chunk_boundaries(
        prefect_api, ray_cluster, arith_files, varied_reward, tmp_path):  # fmt: skip
    """rollout.partial=pause on the hf engine (completion order): when newer weights arrive the rows in
    flight keep their KV cache, the weights load between two decode steps and the same rows go on. Each
    decode step is slowed (tests/integration/slow_stream_plugins.py) so that weights do arrive mid-response.
    The run trains; rows were paused and continued under the new weights (a row with two versions); a
    row's tokens carry non-decreasing versions that change only at a chunk boundary (the interrupt is
    asked there); the staleness bound holds."""
    from flows.train import train

    summary = train(overrides=_stream(tmp_path, arith_files, "stream-pause", varied_reward, **{
        "rollout.partial": "pause", "trainer.total_iterations": "3",
        "trainer.plugins": "[tests.integration.slow_stream_plugins]"}))
    run_dir = Path(summary["run_dir"])
    assert summary["iterations"] == 3
    hist = _history(run_dir)
    mixed = 0
    for it, m in hist.items():
        assert 0 <= m["stream/paused_rows"] <= m["stream/interrupted_rows"], (it, m)
        assert m["rollout/staleness/max"] <= 1 and m["actor/grad_norm"] > 0
        rows = _rollout(run_dir, it)
        vers, mask = rows["rollout_token_versions"], rows["response_mask"]
        for r in range(len(rows)):
            v = vers[r][mask[r]].tolist()
            assert v == sorted(v) and all(i % 3 == 0 for i in range(1, len(v)) if v[i] != v[i - 1]), (it, r, v)
            assert rows["rollout_version"][r] == min(v)
            mixed += len(set(v)) > 1
    assert sum(m["stream/paused_rows"] for m in hist.values()) > 0
    assert mixed > 0  # a paused row went on under the newer weights
