"""workers/weights_endpoint.py: the policy's own engine and a separate rollout pool's engine get
the same weights the same way (full, and with LoRA the adapter only) — workers as plain classes."""

from __future__ import annotations

import pytest
import torch

from tests.unit._worker_helpers import prompt_batch, tiny_cfg, with_advantages
from workers.policy import PolicyWorker
from workers.rollout.capabilities import EngineCapabilities
from workers.rollout_worker import RolloutWorker
from workers.weights_endpoint import push_to_engine


class OwnEngine:
    """An engine holding weights of its own, as vLLM does (and declares: full weights, or the LoRA
    adapter alone): records what reaches it."""

    capabilities = EngineCapabilities(weight_sync=frozenset({"full_state_dict", "lora_adapter"}), lora=True)

    def __init__(self):
        self.received: list[tuple] = []

    def wake_up(self) -> None:
        pass

    def load_weights(self, named) -> None:
        self.received.append(("full", {k: v.detach().clone() for k, v in named}))

    def load_lora_adapter(self, tensors, peft_config, version) -> None:
        self.received.append(("adapter", {k: v.detach().clone() for k, v in tensors.items()}, version))


def _same(a: list[tuple], b: list[tuple]) -> bool:
    """Same kinds of loads with equal tensors (a LoRA adapter's version tag aside: the policy tags
    its own engine's adapter before its weights_version moves on, a rollout rank after)."""
    if [x[0] for x in a] != [x[0] for x in b]:
        return False
    return all(x[1].keys() == y[1].keys() and all(torch.equal(x[1][k], y[1][k]) for k in x[1])
               for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("lora", [False, True])
def test_the_policy_engine_and_a_rollout_engine_end_with_the_same_weights(lora):
    cfg = tiny_cfg(*(["model.lora_rank=2", "actor.lr=1e-2"] if lora else []))
    policy, rollout = PolicyWorker(cfg), RolloutWorker(cfg)
    batch = with_advantages(policy.compute_log_probs(policy.generate_sequences(prompt_batch(policy.tokenizer), seed=1)))
    policy.engine, rollout.engine = OwnEngine(), OwnEngine()
    assert policy.update_policy(batch, expected_version=0, batch_id="b0").applied
    # what publish_weights puts in Ray's object store, filed in the rollout rank's inbox
    rollout._file(1, {k: v.to("cpu", copy=True) for k, v in policy._publish_state().items()}, keep=3)
    rollout.use_weights(1)
    assert _same(policy.engine.received, rollout.engine.received) and len(rollout.engine.received) == 1
    kind, sent, *version = rollout.engine.received[0]
    if lora:  # the adapter alone, tagged with the version: the engine's base weights are never sent
        assert kind == "adapter" and version == [1] and sent
        assert all(".lora_A." in k or ".lora_B." in k for k in sent)
    else:
        assert kind == "full" and sent.keys() == policy.inference_module.state_dict().keys()
    trained = policy.inference_module.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in rollout.inference_module.state_dict().items())
    assert any(not torch.equal(v, sent0) for v, sent0 in zip(sent.values(), _initial(cfg, sent), strict=True))  # it trained


def _initial(cfg, sent: dict) -> list[torch.Tensor]:
    """The same tensors of a freshly built policy (version 0)."""
    fresh = OwnEngine()
    module = RolloutWorker(cfg).inference_module
    push_to_engine(fresh, module, lora=cfg.model.lora_rank > 0, version=0)
    return [fresh.received[0][1][k] for k in sent]


def test_an_engine_sharing_the_module_gets_nothing():
    class Shared(OwnEngine):
        capabilities = EngineCapabilities(weight_sync=frozenset({"shared_module"}))

        def __init__(self, model):
            super().__init__()
            self.model = model

    module = torch.nn.Linear(2, 2)
    engine = Shared(module)
    push_to_engine(engine, module, lora=True, version=3)
    assert engine.received == []
