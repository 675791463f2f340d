"""Multi-turn rollouts under ``trainer.async_mode: stream`` (issue 38): a group is generated whole
by the streamer, newer weights land between turns (never inside a model turn), each turn's tokens
record the version that sampled them, the environment keeps its state across a weights load, and
the take assembles the group with its masks, prompts and non-tensors."""

from __future__ import annotations

import threading

import pytest
import torch

from hybridflow.agents.remote import EnvRunner
from hybridflow.batch import Batch
from hybridflow.config import config_from_dict
from tasks.stream import assemble
from tests.unit.test_rollout_multi_turn import TOK, ScriptedEngine, batch_of, segments
from workers.group_stream import GroupStreamer
from workers.rollout.base import SamplingParams
from workers.rollout.multi_turn import MultiTurnRollout, merge_prompt_metrics

ENV = "tests.unit.test_stream_multi_turn:CounterEnv"


class CounterEnv:
    """A stateful environment: observation ``count <k>`` after its k-th step, done after the third.
    Reset mid-trajectory, it would say ``count 1`` again."""

    def __init__(self) -> None:
        self.k = 0

    def reset(self, row):
        return None

    def step(self, text: str):
        self.k += 1
        return f"count {self.k}", 1.0, self.k >= 3


class PublishingEngine(ScriptedEngine):
    """A ScriptedEngine whose every call is followed by the trainer publishing a newer version
    (``inbox["published"] += 1``): weights arrive while each model turn is generated."""

    def __init__(self, script, inbox: dict) -> None:
        super().__init__(script)
        self.inbox = inbox

    def generate(self, prompt_ids, prompt_mask, sampling):
        out = super().generate(prompt_ids, prompt_mask, sampling)
        self.inbox["published"] += 1
        return out

    def wake_up(self) -> None: ...

    def sleep(self) -> None: ...


@pytest.fixture(scope="module")
def runner():
    r = EnvRunner(num_workers=1, timeout_s=60.0)  # generous: a loaded machine must not turn a step into env_error
    yield r
    r.close()


def _loop(engine, runner) -> MultiTurnRollout:
    cfg = config_from_dict({"rollout": {"environment": ENV, "max_response_tokens": 200,
                                        "multi_turn": {"max_turns": 3}}}).rollout
    return MultiTurnRollout(engine, TOK, cfg, runner)


def test_before_turn_versions_every_turn_and_observations_take_their_turns(runner):
    engine = ScriptedEngine({"Q1": ["one", "two", "three"]})
    versions = iter([5, 6, 6])
    seen = []

    def before_turn(live: int) -> int:
        seen.append(live)
        return next(versions)

    out = _loop(engine, runner).generate(batch_of(["Q1"]), SamplingParams(max_new_tokens=200, n=2),
                                         before_turn=before_turn, per_prompt_metrics=True)
    assert seen == [2, 2, 2]  # two trajectories live at each of the three turns
    for r in range(2):
        real = (out.response_mask[r] | out.observation_mask[r])
        v = out.token_versions[r][real].tolist()
        segs = segments(out.response_mask[r][real].tolist())  # model, obs, model, obs, model
        assert [m for m, _ in segs] == [True, False, True, False, True]
        bounds = [0]
        for _, n in segs:
            bounds.append(bounds[-1] + n)
        per_segment = [set(v[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
        assert per_segment == [{5}, {5}, {6}, {6}, {6}]  # each observation carries the turn before it
        assert out.finish_reason[r] == "env_done" and out.non_tensors["num_turns"][r] == 3
    assert out.metrics == {} and len(out.prompt_metrics) == 1
    assert out.prompt_metrics[0]["multi_turn/num_turns/mean"] == 3 and out.prompt_metrics[0]["multi_turn/finish/env_done"] == 1


def test_without_before_turn_every_token_records_version_zero(runner):
    out = _loop(ScriptedEngine({"Q1": ["a", "b", "c"]}), runner).generate(batch_of(["Q1"]),
                                                                         SamplingParams(max_new_tokens=200))
    assert out.token_versions.abs().sum() == 0 and out.metrics["multi_turn/num_turns/mean"] == 3


def _streamer(engine, loop, inbox: dict, between_turns: bool) -> GroupStreamer:
    def newest() -> int:
        inbox["loaded"] = inbox["published"]
        return inbox["loaded"]

    return GroupStreamer(engine, SamplingParams(max_new_tokens=200, n=2, seed=0), pad_id=TOK.pad_token_id,
                         chunk_tokens=200, batch_rows=64, order="completion", group_size_iter=1, max_staleness=1,
                         load_newest=newest, load_version=lambda v: True, version=lambda: inbox["loaded"],
                         lock=threading.Lock(), multi_turn=loop, between_turns=between_turns)


def _sync_record(gid: int, question: str) -> dict:
    b = batch_of([question])
    return {"gid": gid, "prompt": b["prompt_ids"][0][b["prompt_mask"][0]].tolist(), "seed": 3,
            "fields": {k: v[0] for k, v in b.non_tensors.items()}}


@pytest.mark.parametrize("between_turns, turn_versions", [(True, [0, 1, 2]), (False, [0, 0, 0])])
def test_a_streamed_group_takes_new_weights_between_turns_and_keeps_its_environment(runner, between_turns,
                                                                                    turn_versions):
    inbox = {"published": 0, "loaded": 0}
    engine = PublishingEngine({"Q1": ["one", "two", "three"]}, inbox)
    stream = _streamer(engine, _loop(engine, runner), inbox, between_turns)
    stream.sync([_sync_record(7, "Q1")])
    work = stream._next_work()
    assert work is not None and [g.gid for g in work[0]] == [7]
    assert stream._generate(*work)  # the whole group: three turns, two environment steps each row... and done
    assert stream._next_work() is None
    (done,) = stream.finished()
    assert done["gid"] == 7 and done["oldest_version"] == 0
    (rec,) = stream.pop([7])
    stats = stream.take_stats()
    assert stats["weight_loads"] == (2 if between_turns else 0)
    assert stats["interrupted_rows"] == (4 if between_turns else 0)  # 2 trajectories at each of 2 loads
    assert stats["turns"] == 3  # progress the take sees while a group's turns go on
    mt = rec["multi_turn"]
    for k in range(2):
        mask, vers = mt["model_mask"][k], rec["versions"][k]
        assert len(mask) == len(vers) == len(rec["tokens"][k]) == len(rec["log_probs"][k])
        model_turns, start = [], 0
        for m, n in segments(mask):
            if m:
                model_turns.append(set(vers[start:start + n]))
            start += n
        assert model_turns == [{v} for v in turn_versions]
        assert rec["finish"][k] == "env_done"
        # the environment kept its state across the weights loads: its counter went on
        observations = [m["content"] for m in mt["non_tensors"]["messages"][k] if m["role"] == "user"][1:]
        assert observations == ["count 1", "count 2"]
    assert mt["metrics"]["multi_turn/num_turns/max"] == 3


def test_a_multi_turn_streamer_refuses_submission_order_and_pause(runner):
    engine = PublishingEngine({"Q1": ["x"]}, {"published": 0})
    kw = dict(pad_id=0, chunk_tokens=4, batch_rows=8, group_size_iter=1, max_staleness=0, load_newest=lambda: 0,
              load_version=lambda v: True, version=lambda: 0, lock=threading.Lock(), multi_turn=_loop(engine, runner))
    with pytest.raises(ValueError, match="completion order"):
        GroupStreamer(engine, SamplingParams(max_new_tokens=8), order="submission", **kw)
    with pytest.raises(ValueError, match="never pauses inside a model turn"):
        GroupStreamer(engine, SamplingParams(max_new_tokens=8), order="completion", pause=True, **kw)


def _record(gid: int, model_mask: list[list[bool]], versions: list[list[int]], prompts: list[list[int]]) -> dict:
    return {"gid": gid, "tokens": [[10 + j for j in range(len(m))] for m in model_mask],
            "log_probs": [[-0.5] * len(m) for m in model_mask], "versions": versions,
            "finish": ["env_done"] * len(model_mask), "started_at": 0.0, "finished_at": 1.0, "chunks": 1,
            "multi_turn": {"model_mask": model_mask, "prompts": prompts,
                           "non_tensors": {"env_reward": [1.0, 0.5], "num_turns": [2, 1]},
                           "metrics": {}}}


def test_assemble_a_multi_turn_group_masks_observations_and_versions_rows_by_their_oldest_model_token():
    prompt = Batch.from_dict({"prompt_ids": torch.tensor([[0, 5, 6]]), "prompt_mask": torch.tensor([[False, True, True]])},
                             {"uid": ["u"], "raw_chat": [[{"role": "user", "content": "q"}]]})
    # row 0: model, model, obs, obs, model  (versions 2, 2, 1*, 1*, 3: the observations' versions do not count)
    # row 1: model only, version 4
    rec = _record(9, [[True, True, False, False, True], [True]], [[2, 2, 1, 1, 3], [4]], [[7, 5, 6], [5, 6]])
    rows = assemble([rec], {9: prompt}, 2, pad_id=0)
    assert rows["response_mask"].tolist() == [[True, True, False, False, True], [True, False, False, False, False]]
    assert rows["observation_mask"].tolist() == [[False, False, True, True, False], [False] * 5]
    assert rows["rollout_version"].tolist() == [2, 4]
    assert rows["response_length"] == [3, 1]
    assert rows["rollout_token_versions"][0].tolist() == [2, 2, 1, 1, 3]
    # the conversation starts the environments' reset made replace the sampled prompt
    assert rows["prompt_ids"].tolist() == [[7, 5, 6], [0, 5, 6]]
    assert rows["prompt_mask"].tolist() == [[True, True, True], [False, True, True]]
    # positions run over the prompt and every response token, observations included
    assert rows["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert rows["env_reward"] == [1.0, 0.5] and rows["num_turns"] == [2, 1] and rows["uid"] == ["u", "u"]


def test_merge_prompt_metrics_by_hand():
    a = {"multi_turn/num_turns/mean": 2.0, "multi_turn/num_turns/max": 3.0, "multi_turn/finish/stop": 0.5,
         "tool/errors": 1.0, "env/win_rate": 1.0}
    b = {"multi_turn/num_turns/mean": 1.0, "multi_turn/num_turns/max": 1.0, "multi_turn/finish/stop": 1.0,
         "tool/errors": 2.0}
    out = merge_prompt_metrics([a, b])
    assert out == {"multi_turn/num_turns/mean": 1.5,  # (2 + 1) / 2, equal groups
                   "multi_turn/num_turns/max": 3.0, "multi_turn/finish/stop": 0.75,  # (0.5 + 1) / 2
                   "tool/errors": 3.0,  # 1 + 2
                   "env/win_rate": 1.0}  # only a reports it
    assert merge_prompt_metrics([]) == {}


class _Cache:
    """A stand-in KV cache: which call made it."""

    def __init__(self, call: int) -> None:
        self.call = call

    def truncated(self, n: int) -> _Cache:
        return self


class KeepingEngine(ScriptedEngine):
    """A ScriptedEngine that declares ``continuing_kv`` and records the caches each turn got."""

    from workers.rollout.capabilities import EngineCapabilities

    capabilities = EngineCapabilities(continuing_kv=True)

    def __init__(self, script) -> None:
        super().__init__(script)
        self.caches_in: list[list] = []

    def generate_continuing(self, seqs, caches, sampling):
        self.caches_in.append([None if c is None else c.call for c in caches])
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), TOK.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.bool)
        for i, s in enumerate(seqs):
            ids[i, width - len(s):], mask[i, width - len(s):] = torch.tensor(s), True
        out = self.generate(ids, mask, sampling)
        return out, [_Cache(len(self.caches_in)) for _ in seqs]


@pytest.mark.parametrize("versions, caches", [([0, 0, 0], [[None], [1], [2]]),  # kept from turn to turn
                                              ([0, 1, 1], [[None], [None], [2]])])  # dropped at the load
def test_a_weights_load_between_turns_drops_the_kv_cache_kept_under_the_old_weights(runner, versions, caches):
    engine = KeepingEngine({"Q1": ["one", "two", "three"]})
    turn = iter(versions)
    out = _loop(engine, runner).generate(batch_of(["Q1"]), SamplingParams(max_new_tokens=200),
                                         before_turn=lambda live: next(turn))
    assert engine.caches_in == caches  # the turn after a load prefills the conversation again
    assert out.non_tensors["num_turns"] == [3]
