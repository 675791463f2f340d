"""The streaming mode's driver side without Ray or Prefect (issue 38): the config's async_mode
and its one-line errors, the group stream feed (top-up bound, what a take consumes, spares,
the checkpoint record and a resume from it), the rollout batch assembled from groups, and the
off-policy token mask."""

from __future__ import annotations

import pytest
import torch

from flows.feeds import Feed, open_feed
from flows.iteration import IterationResult
from flows.stream_feed import STATE_KEY, GroupStream, max_inflight_groups
from flows.trainer_state import TrainerState
from hybridflow.algorithms.rollout_correction import fresh_token_mask
from hybridflow.batch import Batch, BatchRef
from hybridflow.config import ConfigError, load_config
from tasks.stream import assemble
from tasks.types import NodeResult, RolloutResult
from tests.unit._worker_helpers import tiny_cfg
from tests.unit.test_feeds import _feed

POOL = "placement.pools.gen.roles=[rollout]"


def test_async_mode_resolves_what_older_configs_meant():
    assert load_config().async_mode == "off"
    assert tiny_cfg("trainer.max_staleness=1", POOL).async_mode == "ahead"
    assert tiny_cfg(POOL).async_mode == "ahead"  # a rollout pool at staleness 0: the loop on separate workers
    cfg = tiny_cfg("trainer.async_mode=stream", "trainer.max_staleness=2", POOL, "data.prompts_per_iteration=4")
    assert cfg.async_mode == "stream" and max_inflight_groups(cfg) == 12  # (s + 1) × G
    assert max_inflight_groups(tiny_cfg("trainer.async_mode=stream", POOL, "rollout.max_inflight_groups=1")) == \
        tiny_cfg().data.prompts_per_iteration  # never fewer than one iteration's groups


def test_vllm_offers_pause_in_completion_order():
    cfg = tiny_cfg("trainer.async_mode=stream", POOL, "rollout.engine=vllm", "rollout.partial=pause")
    assert cfg.rollout.partial == "pause" and cfg.trainer.stream_order == "completion"


def test_hf_offers_pause_in_its_own_decode_loop_lora_included():
    """hf pauses in place (workers/rollout/hf_pause.py); a LoRA adapter is loaded into the shared peft
    module in place and its packed copies rebuilt, so unlike vllm (a request keeps its adapter) LoRA is fine."""
    cfg = tiny_cfg("trainer.async_mode=stream", POOL, "rollout.partial=pause", "model.lora_rank=4")
    assert cfg.rollout.engine == "hf" and cfg.rollout.partial == "pause"


@pytest.mark.parametrize("partial", ["abort", "off"])
def test_multi_turn_rollouts_stream_in_completion_order(partial):
    """Issue 38: a multi-turn group streams whole; weights load between turns (abort) or not at all (off)."""
    cfg = tiny_cfg("trainer.async_mode=stream", POOL, "rollout.tools=[calculator]", f"rollout.partial={partial}")
    assert cfg.async_mode == "stream" and cfg.rollout.is_multi_turn and cfg.rollout.partial == partial
    env = tiny_cfg("trainer.async_mode=stream", POOL, "rollout.environment=tests.unit.agent_fixtures:GuessEnv")
    assert env.async_mode == "stream" and env.rollout.partial == "abort"


@pytest.mark.parametrize("overrides, fragment", [
    (["trainer.async_mode=stream"], "trainer.async_mode=stream needs a rollout pool"),
    (["trainer.async_mode=off", "trainer.max_staleness=1", POOL], "trainer.async_mode=off but trainer.max_staleness=1"),
    (["trainer.updates_per_sync=2"], "trainer.updates_per_sync=2 needs a rollout pool"),
    (["trainer.updates_per_sync=3", "trainer.max_staleness=1", POOL], "lag 2 version(s) behind the trainer, past "
     "trainer.max_staleness=1: set max_staleness >= 2"),
    (["trainer.updates_per_sync=2", "trainer.max_staleness=1", "trainer.async_mode=stream", "trainer.stream_order=submission",
      POOL], "trainer.updates_per_sync=2 with trainer.stream_order=submission"),
    (["trainer.async_mode=stream", POOL, "rollout.partial=pause", "rollout.drop_finished_rows=false"],
     "rollout.partial=pause with rollout.drop_finished_rows=false"),
    (["trainer.async_mode=stream", POOL, "rollout.engine=vllm", "rollout.partial=pause", "trainer.stream_order=submission"],
     "rollout.partial=pause with trainer.stream_order=submission"),
    (["trainer.async_mode=stream", POOL, "rollout.engine=vllm", "rollout.partial=pause", "model.lora_rank=4"],
     "rollout.partial=pause with model.lora_rank=4"),
    (["trainer.async_mode=stream", POOL, "rollout.tools=[calculator]", "rollout.partial=pause"],
     "rollout.partial=pause with rollout.tools / rollout.environment under trainer.async_mode=stream"),
    (["trainer.async_mode=stream", POOL, "rollout.tools=[calculator]", "trainer.stream_order=submission"],
     "trainer.stream_order=submission with rollout.tools / rollout.environment"),
    (["trainer.async_mode=flow"], "trainer.async_mode"),
    (["trainer.async_mode=stream", POOL, "rollout.partial=sometimes"], "rollout.partial"),
    (["rollout.partial_chunk_tokens=0"], "rollout.partial_chunk_tokens"),
    (["actor.max_token_staleness=-1"], "actor.max_token_staleness"),
])
def test_stream_config_errors_are_one_line_naming_the_key(overrides, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert fragment in str(e.value) and "Traceback" not in str(e.value)


class _Future:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value.to_json()


def _stream(tmp_path, trainer: TrainerState, *extra: str, drop: int = 0):
    """A GroupStream over the test's scripted sampler (2 prompts per draw, 5 epochs of 2 draws) with
    a fake take that consumes the ``count`` lowest gids (dropping ``drop`` of them first, replaced by
    spares)."""
    calls = []

    def take(iteration, wanted, spare, count, version, published):
        calls.append({"iteration": iteration, "wanted": [e["gid"] for e in wanted],
                      "spare": [e["gid"] for e in spare], "count": count, "version": version,
                      "published": published})
        gids = sorted(e["gid"] for e in wanted)
        dropped, started = gids[:drop], [e["gid"] for e in spare[:drop]]
        taken = [g for g in gids if g not in dropped][:count]
        ref = BatchRef("r", iteration, "rollout", f"/x/{iteration}", 4, ("response_ids",), "c")
        return _Future(RolloutResult(node="rollout", ref=ref, rollout_version=version, groups=tuple(taken),
                                     dropped=tuple(dropped), started=tuple(started),
                                     metrics={"rollout/staleness/max": 1.0, "stream/busy_fraction": 0.5}))

    cfg = tiny_cfg("trainer.async_mode=stream", "trainer.max_staleness=1", POOL, "trainer.total_iterations=4",
                   "data.prompts_per_iteration=2", *extra)
    return open_feed(cfg, _feed(tmp_path, total_epochs=5), trainer, lambda *a: None, take), calls


def test_the_stream_keeps_s_plus_1_iterations_of_groups_in_flight_and_each_take_consumes_its_groups(tmp_path):
    trainer = TrainerState(kl_coef=0.0)
    feed, calls = _stream(tmp_path, trainer)
    assert isinstance(feed, GroupStream) and isinstance(feed, Feed)
    taken = feed.take(1)
    assert isinstance(taken.first, RolloutResult) and taken.first.groups == (0, 1)
    assert calls[0] == {"iteration": 1, "wanted": [0, 1, 2, 3], "spare": [], "count": 2, "version": 0, "published": 0}
    assert [e["gid"] for e in feed.inflight] == [2, 3]
    trainer.policy_version = 1
    feed.take(2)
    assert calls[1]["wanted"] == [2, 3, 4, 5] and calls[1]["version"] == 1
    entry = feed.inflight[0]
    assert set(entry) == {"gid", "uri", "checksum", "row", "seed"}
    assert Batch.load(entry["uri"], expected_checksum=entry["checksum"])["uid"][entry["row"]] == "u4"
    out = IterationResult({}, {})
    feed.settle(taken, out, (0.0, 2.0), 2.0)
    assert out.results["rollout"] is taken.first and out.metrics["async/overlap_fraction"] == 0.5


def test_a_take_names_the_newest_published_version_apart_from_the_trainers(tmp_path):
    """trainer.updates_per_sync: staleness is counted against the trainer's version, while the rollout
    pool must hold only the newest version published to it."""
    trainer = TrainerState(kl_coef=0.0, policy_version=3, published_version=2)
    feed, calls = _stream(tmp_path, trainer, "trainer.updates_per_sync=2")
    feed.take(1)
    assert calls[0]["version"] == 3 and calls[0]["published"] == 2


def test_the_checkpoint_record_resumes_the_same_groups_and_the_sampler_goes_on_after_them(tmp_path):
    trainer = TrainerState(kl_coef=0.0)
    feed, _ = _stream(tmp_path, trainer)
    feed.take(1)
    record = feed.in_flight()
    assert list(record) == [STATE_KEY] and record[STATE_KEY]["next_gid"] == 4
    resumed_state = TrainerState(kl_coef=0.0, rollouts=record)
    resumed, calls = _stream(tmp_path, resumed_state)
    sampler = resumed.prompts.sampler
    sampler.step = feed.prompts.sampler.step  # the checkpoint's sampler position (TrainerState.sampler)
    resumed.take(2)
    assert calls[0]["wanted"] == [2, 3, 4, 5]  # the recorded groups, then new draws with new gids
    assert resumed_state.rollouts == {}


def test_a_drop_starts_spare_prompts_and_none_is_lost(tmp_path):
    trainer = TrainerState(kl_coef=0.0)
    feed, calls = _stream(tmp_path, trainer, "trainer.staleness_policy=drop", drop=1)
    result = feed.take(1).first
    assert calls[0]["spare"] == [4, 5] and result.dropped == (0,) and result.started == (4,)
    held = sorted(e["gid"] for e in feed.inflight + feed.queue)
    assert held == [3, 4, 5] and sorted(result.groups) == [1, 2]


def test_a_stream_record_is_not_taken_over_by_another_mode(tmp_path, caplog):
    trainer = TrainerState(kl_coef=0.0, rollouts={STATE_KEY: {"next_gid": 2, "inflight": [], "queue": []}})
    cfg = tiny_cfg("trainer.max_staleness=1", POOL)
    with caplog.at_level("WARNING"):
        feed = open_feed(cfg, _feed(tmp_path), trainer, lambda *a: None)
    assert not isinstance(feed, GroupStream) and trainer.rollouts == {}
    assert "stream groups" in caplog.text


def test_assemble_gives_the_batch_contract_with_per_token_versions():
    prompts = {g: Batch.from_dict({"prompt_ids": torch.tensor([[0, 5, 6]]), "prompt_mask": torch.tensor([[0, 1, 1]]).bool()},
                                  {"uid": [f"u{g}"]}) for g in (7, 9)}
    groups = [{"gid": 9, "tokens": [[1, 2, 3], [4]], "log_probs": [[-1.0, -2.0, -3.0], [-4.0]],
               "versions": [[3, 3, 4], [4]], "finish": ["length", "stop"]},
              {"gid": 7, "tokens": [[8, 8], [9]], "log_probs": [[-0.5, -0.5], [-0.1]], "versions": [[2, 2], [4]],
               "finish": ["stop", "stop"]}]
    rows = assemble(groups, prompts, 2, pad_id=0)
    assert rows["uid"] == ["u9", "u9", "u7", "u7"] and rows["stream_gid"] == [9, 9, 7, 7]
    assert rows["response_ids"].tolist() == [[1, 2, 3], [4, 0, 0], [8, 8, 0], [9, 0, 0]]
    assert rows["rollout_token_versions"].tolist() == [[3, 3, 4], [4, 0, 0], [2, 2, 0], [4, 0, 0]]
    assert rows["rollout_token_versions"].dtype == torch.int64
    assert rows["rollout_version"].tolist() == [3, 4, 2, 4]  # each row's oldest token
    assert rows["rollout_log_probs"][0].tolist() == [-1.0, -2.0, -3.0]
    assert rows["position_ids"][0].tolist() == [0, 0, 1, 2, 3, 4] and rows["response_length"] == [3, 1, 2, 1]


def test_fresh_token_mask_drops_tokens_older_than_the_bound():
    versions = torch.tensor([[5, 6, 7], [7, 7, 0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    keep, stale = fresh_token_mask(versions, mask, policy_version=7, max_token_staleness=1)
    assert keep.tolist() == [[False, True, True], [True, True, False]]
    assert stale == pytest.approx(1 / 5)  # the padding position does not count
    with pytest.raises(ValueError, match="differ"):
        fresh_token_mask(versions[:, :2], mask, 7, 1)


def test_rollout_result_groups_survive_the_json_round_trip():
    r = RolloutResult(node="rollout", rollout_version=2, groups=(4, 5), dropped=(1,), started=(6,))
    back = NodeResult.of(r.to_json())
    assert back == r and back.to_json()["groups"] == [4, 5]


def test_a_resume_at_an_epoch_boundary_trains_every_group_once_and_then_stops(tmp_path):
    """verl #7401 (resume repeating or losing data at an epoch boundary), for the stream: two epochs
    of two draws of two prompts; the checkpoint after iteration 1 falls on the epoch boundary."""
    trainer = TrainerState(kl_coef=0.0)
    feed, calls = _stream(tmp_path, trainer)
    feed.prompts.total_epochs = 2
    trained = list(feed.take(1).first.groups)
    record, step = feed.in_flight(), feed.prompts.sampler.step
    assert feed.prompts.sampler.epoch == 1 and record[STATE_KEY]["inflight"]  # at the boundary, groups in flight
    resumed, calls = _stream(tmp_path, TrainerState(kl_coef=0.0, rollouts=record))
    resumed.prompts.total_epochs, resumed.prompts.sampler.step = 2, step
    for it in (2, 3, 4):
        trained += list(resumed.take(it).first.groups)
    assert resumed.take(5) is None  # the epochs are done and no whole iteration is left
    assert trained == list(range(8))
    uids = []
    for c in calls:  # the prompts behind the groups: each drawn once
        uids += [c["wanted"]]
    assert sorted({g for w in uids for g in w}) == list(range(2, 8))


# ---- the take (tasks/stream.py) against a scripted rollout pool --------------------------------------


class _Pool:
    """The rollout role's handle as the take sees it (one rank): groups finish when the script says."""

    def __init__(self, oldest: dict[int, int], stalled: bool = False):
        self.oldest, self.stalled = oldest, stalled  # gid -> its oldest token's version
        self.held: set[int] = set()
        self.synced: list[list[int]] = []
        self.popped: list[int] = []

    def stream_sync(self, wanted):
        self.synced.append([w["gid"] for w in wanted])
        self.held = {w["gid"] for w in wanted}
        return [{}]

    def stream_finished(self):
        if self.stalled:
            return [[]]
        return [[{"gid": g, "done_seq": g, "finished_at": float(g), "oldest_version": self.oldest.get(g, 5)}
                 for g in sorted(self.held)]]

    def stream_pop(self, gids):
        self.popped += list(gids)
        self.held -= set(gids)
        self.oldest = {g: 5 for g in self.oldest}  # a regenerated group comes back with the newest weights
        return [[{"gid": g, "tokens": [[1, 2], [3]], "log_probs": [[-1.0, -1.0], [-1.0]],
                  "versions": [[self.oldest.get(g, 5)] * 2, [5]], "finish": ["stop", "stop"],
                  "started_at": 0.0, "finished_at": 1.0, "chunks": 1} for g in gids]]

    def stream_stats(self, reset=True):
        return [{"busy_s": 1.0, "idle_s": 1.0, "weight_loads": 0, "interrupted_rows": 0, "prefill_tokens": 0,
                 "tokens": 0, "pad_id": 0}]


def _take(tmp_path, monkeypatch, pool: _Pool, *extra: str, spare: int = 0, published: int | None = None):
    import tasks.stream as S
    from tasks.common import RunContext

    monkeypatch.setattr(S, "pool_of", lambda run, role: pool)
    pool.delivered = []
    monkeypatch.setattr(S, "weight_sync",
                        lambda run, rollout: type("W", (), {"deliver": lambda self, v: pool.delivered.append(v)})())
    prompts = Batch.from_dict({"prompt_ids": torch.tensor([[0, 5, 6]] * 6), "prompt_mask": torch.tensor([[0, 1, 1]] * 6).bool()},
                              {"uid": [f"u{i}" for i in range(6)]})
    ref = prompts.save(str(tmp_path / "prompts"))
    entries = [{"gid": g, "uri": ref.uri, "checksum": ref.checksum, "row": g, "seed": g} for g in range(6)]
    cfg = tiny_cfg("trainer.async_mode=stream", "trainer.max_staleness=1", POOL, "rollout.samples_per_prompt=2",
                   "data.prompts_per_iteration=2", *extra)
    run = RunContext("r", str(tmp_path), 3, "ns", 0, cfg.model_dump(mode="json"))
    return S._take_groups.fn(run, entries[:4], entries[4:4 + spare], 2, 5, published)


def test_the_take_regenerates_a_stale_group_and_keeps_the_batch_whole(tmp_path, monkeypatch):
    pool = _Pool({0: 3, 1: 5, 2: 5, 3: 5})  # group 0's oldest token is 2 versions behind v5
    rows, result = _take(tmp_path, monkeypatch, pool)
    assert result.groups == (1, 0) and result.dropped == ()  # 1 first; 0 generated again, then taken
    assert pool.synced[0] == [0, 1, 2, 3] and len(pool.synced) == 2  # re-synced after forgetting 0
    assert rows.meta["metrics"]["rollout/regenerated_stale"] == 2.0  # its 2 trajectories
    assert rows["rollout_token_versions"].shape == rows["response_mask"].shape and len(rows) == 4


def test_the_take_delivers_the_newest_published_version_and_counts_staleness_against_the_trainer(tmp_path,
                                                                                                monkeypatch):
    pool = _Pool({0: 4, 1: 4, 2: 4, 3: 4})  # generated with v4, the newest published; the trainer is at v5
    rows, result = _take(tmp_path, monkeypatch, pool, "trainer.updates_per_sync=2", published=4)
    assert pool.delivered == [4] and result.dropped == ()
    assert rows.meta["metrics"]["rollout/regenerated_stale"] == 0.0  # 1 version behind v5: within the bound
    pool = _Pool({0: 4, 1: 4, 2: 4, 3: 4})
    _take(tmp_path, monkeypatch, pool)
    assert pool.delivered == [5]  # every update published: the trainer's own version


def test_the_take_drops_a_stale_group_and_starts_a_spare(tmp_path, monkeypatch):
    pool = _Pool({0: 3, 1: 5, 2: 5, 3: 5})
    rows, result = _take(tmp_path, monkeypatch, pool, "trainer.staleness_policy=drop", spare=2)
    assert result.dropped == (0,) and result.started == (4,) and result.groups == (1, 2)
    assert pool.synced[-1] == [1, 2, 3, 4]
    assert rows.meta["metrics"]["rollout/dropped_stale"] == 2.0


def test_a_take_that_sees_no_progress_fails_in_one_line(tmp_path, monkeypatch):
    import tasks.stream as S

    with pytest.raises(S.StreamStalled, match=r"generated nothing for 0.5 s \(trainer.stream_timeout_s\) with 4 group"):
        _take(tmp_path, monkeypatch, _Pool({}, stalled=True), "trainer.stream_timeout_s=0.5")


def test_partial_spans_count_the_versions_each_trajectory_crossed():
    from tasks.stream import partial_spans

    versions = torch.tensor([[3, 3, 4, 6], [5, 5, 5, 0], [2, 9, 9, 9], [7, 7, 7, 7]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]])
    # row 0: v3..v6 -> 4; row 1: v5 only (the pad's v0 is not a token) -> 1; row 2: no tokens -> 0; row 3: 1
    assert partial_spans(versions, mask).tolist() == [4, 1, 0, 1]
    assert partial_spans(versions, torch.zeros_like(mask)).tolist() == [0, 0, 0, 0]


def test_the_take_reports_verls_partial_and_idle_metrics(tmp_path, monkeypatch):
    """Groups generated under one version report no partial trajectory; when each group's first
    trajectory crossed v4 -> v5, half the trajectories are partial, spanning 2 versions. The
    scripted pool's busy 1 s / idle 1 s gives rollouter/idle_ratio 0.5."""
    pool = _Pool({0: 5, 1: 5, 2: 5, 3: 5})
    rows, _ = _take(tmp_path, monkeypatch, pool)
    m = rows.meta["metrics"]
    assert m["partial/partial_ratio"] == 0.0 and m["partial/max_partial_span"] == 1.0
    assert m["rollouter/idle_ratio"] == 0.5

    class Mixed(_Pool):
        def stream_pop(self, gids):
            out = super().stream_pop(gids)
            for rec in out[0]:
                rec["versions"] = [[4, 5], [5]]  # the first trajectory crossed v4 -> v5
            return out

    rows, _ = _take(tmp_path / "mixed", monkeypatch, Mixed({0: 5, 1: 5, 2: 5, 3: 5}))
    m = rows.meta["metrics"]
    assert m["partial/partial_ratio"] == 0.5 and m["partial/max_partial_span"] == 2.0
