"""The orchestration core with fake nodes and fake pools: the graph and its errors, wiring, cache
keys, node outputs, result types through Prefect's result records, role handles, and the one
owner of weights versions (tasks.versions)."""

from __future__ import annotations

import json
import types
import warnings

import pytest
import torch

from flows.dataflow import DataFlow, DataFlowError, node
from hybridflow.batch import Batch
from tasks.common import RunContext, node_cache_key
from tasks.node import save_output, split_node_output
from tasks.results import check_result_record
from tasks.types import AdvantageResult, NodeResult, UpdateResult
from tasks.versions import VersionError, apply_update, read_ledger, record_updates, sync_to_version
from tests.unit._worker_helpers import tiny_cfg

# ---- fake nodes -------------------------------------------------------------------------------


@node(name="gen")
def gen(run, prompts: Batch) -> Batch: ...


@node(name="score")
def score(run, gen: Batch) -> Batch: ...


@node(name="adv")
def adv(run, gen: Batch, score: Batch, ref: Batch | None = None) -> Batch: ...


@node(name="keep")
def keep(run, gen: Batch, score: Batch) -> Batch: ...


def test_wiring_by_name_and_the_order():
    df = DataFlow([adv, score, gen], inputs=("prompts",))
    assert df.wiring == {"adv": {"gen": "gen", "score": "score", "ref": None},
                         "score": {"gen": "gen"}, "gen": {"prompts": "input:prompts"}}
    assert df.order == ["gen", "score", "adv"]


def test_a_missing_input_names_the_node_and_the_parameter():
    with pytest.raises(DataFlowError, match=r"node 'score': parameter 'gen' is not provided"):
        DataFlow([score, adv], inputs=("prompts",))


def test_wiring_to_a_missing_node_says_where_it_was_wired():
    with pytest.raises(DataFlowError, match=r"node 'adv': parameter 'score' is not provided: wired to 'nope'"):
        DataFlow([gen, score, adv.wire(score="nope")], inputs=("prompts",))


def test_duplicate_names_and_input_clashes():
    with pytest.raises(DataFlowError, match=r"duplicate node names: \['gen'\]"):
        DataFlow([gen, gen], inputs=("prompts",))
    with pytest.raises(DataFlowError, match=r"flow inputs \['gen'\] have the same name as nodes"):
        DataFlow([gen], inputs=("prompts", "gen"))


def test_a_cycle_is_named():
    with pytest.raises(DataFlowError, match=r"cycle in the dataflow: .*(gen -> score|score -> gen)"):
        DataFlow([gen.wire(prompts="score"), score], inputs=("prompts",))


def test_wire_refuses_a_parameter_the_node_does_not_have():
    with pytest.raises(ValueError, match=r"node 'adv' has no parameter\(s\) \['rollout'\]"):
        adv.wire(rollout="gen")


def test_add_and_rewire_put_a_filter_before_a_consumer():
    base = DataFlow([gen, score, adv], inputs=("prompts",))
    df = base.add(keep, before="adv").rewire("adv", gen="keep", score="keep")
    assert df.wiring["adv"] == {"gen": "keep", "score": "keep", "ref": None}
    assert df.wiring["keep"] == {"gen": "gen", "score": "score"}
    assert df.order == ["gen", "score", "keep", "adv"]
    assert base.wiring["adv"]["gen"] == "gen"  # the original is unchanged
    with pytest.raises(DataFlowError, match=r"node 'adv': parameter 'gen' is not provided: wired to 'keep'"):
        df.without("keep")
    with pytest.raises(DataFlowError, match=r"no node 'nope' in the dataflow"):
        base.rewire("nope", gen="gen")


def test_deprecated_overrides_give_the_same_wiring_as_rewire():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        @node(name="keep", overrides=("gen", "score"))
        def old_keep(run, gen: Batch, score: Batch) -> Batch: ...

        df = DataFlow([gen, score, old_keep, adv], inputs=("prompts",))
    assert any(issubclass(w.category, FutureWarning) and "overrides" in str(w.message) and "0.3.0" in str(w.message)
               for w in caught)
    explicit = DataFlow([gen, score, keep, adv], inputs=("prompts",)).rewire("adv", gen="keep", score="keep")
    assert df.wiring == explicit.wiring  # keep itself still reads the originals (it feeds on them)


def test_builtin_dataflow_shows_its_edges_and_pools():
    from flows.iteration import builtin_dataflow

    cfg = tiny_cfg("algorithm.filter_groups=true")
    df = builtin_dataflow(cfg)
    assert df.wiring["advantage"]["rollout"] == "filter_groups" and df.wiring["advantage"]["reward"] == "filter_groups"
    assert df.wiring["filter_groups"] == {"rollout": "rollout", "reward": "reward"}
    text = df.describe({"policy": "main", "reward": "reward"})
    assert "advantage(rollout <- filter_groups, reward <- filter_groups" in text
    assert "rollout(prompts <- prompts, policy_version <- policy_version)  calls policy @ pool main" in text
    plain = builtin_dataflow(tiny_cfg())
    assert plain.wiring["advantage"]["rollout"] == "rollout" and "filter_groups" not in plain.wiring


# ---- cache keys --------------------------------------------------------------------------------


def _run(tmp_path, iteration: int = 3) -> RunContext:
    return RunContext("r1", str(tmp_path), iteration, "ns", 0, {})


def _result(tmp_path, node_name: str, value: float) -> NodeResult:
    batch = Batch.from_dict({"x": torch.tensor([[value]])}, {"uid": ["a"]})
    ref = batch.save(f"{tmp_path}/iter_000003/{node_name}", run_id="r1", iteration=3, node=node_name)
    return NodeResult(node=node_name, ref=ref)


def test_cache_key_is_the_inputs_refs(tmp_path):
    ctx = types.SimpleNamespace(task=types.SimpleNamespace(name="adv"))
    a, b = _result(tmp_path, "gen", 1.0), _result(tmp_path, "score", 2.0)
    key = node_cache_key(ctx, {"run": _run(tmp_path), "gen": a, "score": b, "kl_coef": 0.1})
    assert key == node_cache_key(ctx, {"run": _run(tmp_path), "gen": a, "score": b, "kl_coef": 0.1})
    assert key.startswith("r1-iter000003-adv-")
    # the same result as JSON (a record written before the result types) keys the same
    assert key == node_cache_key(ctx, {"run": _run(tmp_path), "gen": a.to_json(), "score": b, "kl_coef": 0.1})
    changed = _result(tmp_path, "score", 5.0)
    assert node_cache_key(ctx, {"run": _run(tmp_path), "gen": a, "score": changed, "kl_coef": 0.1}) != key
    assert node_cache_key(ctx, {"run": _run(tmp_path, 4), "gen": a, "score": b, "kl_coef": 0.1}) != key
    assert node_cache_key(ctx, {"run": _run(tmp_path), "gen": a, "score": b, "kl_coef": 0.2}) != key



def test_run_context_cfg_is_parsed_once_and_changes_no_key_pickle_or_equality(tmp_path, monkeypatch):
    import dataclasses
    import pickle

    import cloudpickle

    import hybridflow.config as C

    calls = []
    parse = C.config_from_dict
    monkeypatch.setattr(C, "config_from_dict", lambda d: calls.append(1) or parse(d))
    ctx = types.SimpleNamespace(task=types.SimpleNamespace(name="adv"))
    run = RunContext("r1", str(tmp_path), 3, "ns", 0, {"actor": {"lr": 2e-6}})
    key, pickled, cloud, fields = (node_cache_key(ctx, {"run": run}), pickle.dumps(run), cloudpickle.dumps(run),
                                   dataclasses.asdict(run))
    cfg = run.cfg()
    assert run.cfg() is cfg and cfg.actor.lr == 2e-6 and len(calls) == 1  # parsed once
    assert run.with_iteration(4).cfg() is cfg and len(calls) == 1  # the next iteration shares it
    # the cache is invisible: the same cache key, pickled bytes (Ray tasks, Prefect hashing), fields, equality
    assert node_cache_key(ctx, {"run": run}) == key
    assert pickle.dumps(run) == pickled and cloudpickle.dumps(run) == cloud
    assert dataclasses.asdict(run) == fields and run == RunContext("r1", str(tmp_path), 3, "ns", 0, {"actor": {"lr": 2e-6}})
    again = pickle.loads(pickle.dumps(run))
    assert again == run and again.cfg() == cfg and len(calls) == 2  # rebuilt on the other side

# ---- node outputs and result types ------------------------------------------------------------


def test_what_a_node_returns_becomes_its_result(tmp_path):
    run = _run(tmp_path)
    batch = Batch.from_dict({"x": torch.ones(2, 1)}, {"uid": ["a", "b"]})
    batch.meta.update(metrics={"w/m": 2}, logs=["line"])
    result, logs = save_output(run, "adv", (batch, AdvantageResult(node="adv", metrics={"a": 1.0}, kl_coef_next=0.2)))
    assert isinstance(result, AdvantageResult) and result.kl_coef_next == 0.2 and logs == ["line"]
    assert result.metrics == {"w/m": 2.0, "a": 1.0} and result.ref.rows == 2
    assert "metrics" not in result.load().meta  # the worker's report is not saved with the batch
    assert split_node_output("n", {"m": 1, "text": "x"})[1] == NodeResult(node="n", metrics={"m": 1.0})
    with pytest.raises(TypeError, match="node 'n' returned list"):
        split_node_output("n", [1])


@pytest.mark.parametrize("result", [
    NodeResult(node="reward", metrics={"critic/score/mean": 0.5}),
    AdvantageResult(node="advantage", metrics={}, kl_coef_next=0.05),
    AdvantageResult(node="advantage", kl_coef_next=None),
    UpdateResult(node="update_policy", metrics={"actor/pg_loss": -0.1}, applied=False, version=4),
])
def test_result_types_round_trip_through_prefect_result_records(tmp_path, result):
    from prefect._internal.result_records import ResultRecord, ResultRecordMetadata

    from tasks.serializer import NodeResultSerializer

    if result.node == "reward":
        result = dataclass_with_ref(result, _result(tmp_path, "reward", 1.0).ref)
    assert NodeResult.from_json(json.loads(json.dumps(result.to_json()))) == result
    record = ResultRecord(metadata=ResultRecordMetadata(serializer=NodeResultSerializer(), storage_key="k"),
                          result=result)
    path = tmp_path / "r1-iter000003-reward-0123456789abcdef"
    path.write_bytes(record.serialize())
    assert check_result_record(path)["kind"] == result.kind  # the guard accepts what we write
    assert ResultRecord.deserialize(path.read_bytes()).result == result


def dataclass_with_ref(result, ref):
    import dataclasses

    return dataclasses.replace(result, ref=ref)


def test_a_record_with_a_wrong_field_type_is_refused(tmp_path):
    from tasks.results import ResultRecordError

    bad = json.dumps({"kind": "update", "node": "update_policy", "ref": None, "metrics": {},
                      "applied": True, "version": "3"})
    path = tmp_path / "rec"
    path.write_text(json.dumps({"metadata": {"serializer": {"type": "hybridflow-node-result"}, "storage_key": "k"},
                                "result": bad}))
    with pytest.raises(ResultRecordError, match=r"field\(s\) \['version'\] have the wrong type"):
        check_result_record(path)
    with pytest.raises(ValueError, match="unknown node result kind 'other'"):
        NodeResult.from_json({"kind": "other", "node": "x"})


# ---- role handles ------------------------------------------------------------------------------


def test_a_role_handle_binds_the_worker_methods_with_their_protocols(monkeypatch):
    from workers import handles

    calls = []
    monkeypatch.setattr(handles, "call_ranks", lambda pool, role, method, proto, args, kwargs, timeout_s:
                        calls.append((role, method, proto.name, args, kwargs)) or "joined")
    pool = types.SimpleNamespace(name="main", roles=("policy", "reference"), world_size=2, actors=[None, None])
    policy = handles.RoleHandle(pool, "policy")
    assert policy.generate_sequences("prompts", seed=3) == "joined"
    assert policy.generate_sequences.protocol == "dp_scatter"
    assert policy.get_weights_version.protocol == "broadcast"
    assert calls == [("policy", "generate_sequences", "dp_scatter", ("prompts",), {"seed": 3})]
    with pytest.raises(AttributeError, match=r"PolicyWorker \(role 'policy'\) has no method 'generate'"):
        policy.generate("x")
    with pytest.raises(Exception, match=r"pool 'main' has no role 'critic'"):
        handles.RoleHandle(pool, "critic")


# ---- the version owner -------------------------------------------------------------------------


class FakeTrainedRole:
    """A role handle whose worker keeps VersionedUpdates' contract (workers.training)."""

    role = "policy"

    def __init__(self, version: int = 0):
        from workers.training import VersionedUpdates

        self.versions = VersionedUpdates("policy", "actor", weights_version=version)
        self.applied: list[str] = []
        self.skip = False

    def get_weights_version(self) -> list[int]:
        return [self.versions.weights_version, self.versions.weights_version]

    def update_policy(self, batch: Batch, *, expected_version: int, batch_id: str):
        from workers.training import UpdateOutcome

        def fn():
            self.applied.append(batch_id)
            return UpdateOutcome(applied=not self.skip, metrics={"actor/pg_loss": 0.1,
                                                                 "actor/update_skipped": float(self.skip)})

        return self.versions.run(expected_version, batch_id, fn)


def _ledger_run(tmp_path, n_updates: int) -> tuple[RunContext, list[str]]:
    run, ids = _run(tmp_path), []
    live = FakeTrainedRole()
    for v in range(n_updates):
        ref = _result(tmp_path, f"advantage{v}", float(v)).ref
        apply_update(run, "policy", live, ref, v)
        ids.append(ref.checksum)
    return run, ids


def test_a_restarted_pool_is_replayed_to_the_expected_version(tmp_path):
    run, ids = _ledger_run(tmp_path, 3)
    assert [e["version_before"] for e in read_ledger(run.run_dir, "policy")] == [0, 1, 2]
    restarted = FakeTrainedRole(version=1)  # restored an older checkpoint
    sync_to_version(run, "policy", restarted, 3)
    assert restarted.applied == ids[1:] and restarted.versions.weights_version == 3
    sync_to_version(run, "policy", restarted, None)  # None: no check


def test_a_pool_ahead_of_the_run_or_a_missing_ledger_entry_is_an_error(tmp_path):
    run, _ = _ledger_run(tmp_path, 1)
    with pytest.raises(VersionError, match="policy pool is at weights_version 3, ahead of the 1 the run expects"):
        sync_to_version(run, "policy", FakeTrainedRole(version=3), 1)
    with pytest.raises(VersionError, match=r"the ledger .*updates_policy.jsonl has no update recorded at version 1"):
        sync_to_version(run, "policy", FakeTrainedRole(version=0), 2)


def test_an_update_is_applied_once_and_its_retry_returns_its_metrics(tmp_path):
    run = _run(tmp_path)
    role, ref = FakeTrainedRole(), _result(tmp_path, "advantage", 1.0).ref
    first = apply_update(run, "policy", role, ref, 0)
    again = apply_update(run, "policy", role, ref, 0)  # a Prefect retry after the worker applied it
    assert first == UpdateResult(node="update_policy", metrics=first.metrics, applied=True, version=1)
    assert again.applied and again.version == 1 and role.applied == [ref.checksum]
    assert len(read_ledger(run.run_dir, "policy")) == 1
    state = types.SimpleNamespace(policy_version=0, critic_version=5)
    record_updates(state, {"update_policy": again, "reward": NodeResult(node="reward")})
    assert (state.policy_version, state.critic_version) == (1, 5)


def test_a_skipped_update_keeps_the_version_and_is_not_recorded(tmp_path):
    run = _run(tmp_path)
    role = FakeTrainedRole()
    role.skip = True
    result = apply_update(run, "policy", role, _result(tmp_path, "advantage", 1.0).ref, 0)
    assert not result.applied and result.version == 0 and read_ledger(run.run_dir, "policy") == []


def test_applied_is_the_outcome_field_not_the_metric_name(tmp_path):
    """The decision travels in UpdateOutcome.applied: metrics that say otherwise decide nothing."""
    from workers.training import UpdateOutcome, VersionedUpdates

    versions = VersionedUpdates("policy", "actor")
    out = versions.run(0, "b0", lambda: UpdateOutcome(applied=False, metrics={"actor/update_skipped": 0.0}))
    assert not out.applied and versions.weights_version == 0 and out["actor/weights_version"] == 0.0
    out = versions.run(0, "b1", lambda: UpdateOutcome(applied=True, metrics={"actor/update_skipped": 1.0}))
    assert out.applied and versions.weights_version == 1
    again = versions.run(0, "b1", lambda: pytest.fail("a retry must not apply again"))
    assert again.applied and dict(again) == {"actor/update_skipped": 1.0, "actor/weights_version": 1.0}
    run, role = _run(tmp_path), FakeTrainedRole()
    role.update_policy = lambda batch, **kw: UpdateOutcome(applied=False, metrics={"actor/update_skipped": 0.0})
    result = apply_update(run, "policy", role, _result(tmp_path, "advantage", 1.0).ref, 0)
    assert not result.applied and result.version == 0 and read_ledger(run.run_dir, "policy") == []


@pytest.mark.parametrize("extra", [[], ["actor.use_kl_loss=true"], ["algorithm.adv_estimator=gae"],
                                   ["algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true"]])
def test_builtin_wiring_with_the_filter_equals_the_former_overrides_rule(extra):
    """Before the explicit wiring, filter_groups declared overrides=("rollout", "reward"): every node
    that does not feed it — reference, values, advantage — read its output. The same edges now."""
    import dataclasses

    from flows.iteration import builtin_dataflow, flow_inputs
    from tasks.advantage import advantage
    from tasks.filter_groups import filter_groups
    from tasks.reference import reference
    from tasks.reward import reward
    from tasks.rollout import rollout
    from tasks.update import update_critic, update_policy
    from tasks.values import values

    cfg = tiny_cfg("algorithm.filter_groups=true", *extra)
    old_filter = dataclasses.replace(filter_groups, overrides=("rollout", "reward"))
    old_nodes = [rollout, reward] + ([reference] if cfg.needs_reference else []) + (
        [values] if cfg.needs_critic else []) + [old_filter, advantage] + (
        [update_critic] if cfg.needs_critic else []) + [update_policy]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        former = DataFlow(old_nodes, inputs=flow_inputs(cfg))
    now = builtin_dataflow(cfg)
    assert now.wiring == former.wiring and now.order == former.order


def _returns_none(cfg):
    return None


def _missing_input(cfg):
    from flows.iteration import builtin_dataflow

    return builtin_dataflow(cfg).add(score)  # score reads 'gen', which nothing provides


@pytest.mark.parametrize("spec, message", [
    ("nope_module:x", r"trainer.dataflow=nope_module:x: ModuleNotFoundError: No module named 'nope_module'"),
    ("tests.unit.test_orchestration_core", r"expected 'module:function'"),
    ("tests.unit.test_orchestration_core:nothere", r"AttributeError: .*'nothere'"),
    ("tests.unit.test_orchestration_core:_returns_none", r"returned NoneType, not a DataFlow"),
    ("tests.unit.test_orchestration_core:_missing_input", r"node 'score': parameter 'gen' is not provided"),
])
def test_a_bad_trainer_dataflow_is_one_config_error(spec, message):
    from flows.iteration import build_dataflow
    from hybridflow.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        build_dataflow(tiny_cfg(f"trainer.dataflow={spec}"))
