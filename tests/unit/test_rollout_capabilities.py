"""Declared engine capabilities (workers/rollout/capabilities.py): each engine's declaration is
what it really supports, an engine that declares nothing keeps the old behaviour, callers read the
declaration, and no probe of an engine (``hasattr(engine, ...)``, ``inspect.signature(...)`` of an
engine, ``getattr(engine, "<name>")``) comes back into workers/, tasks/ or flows/."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from hybridflow.config import config_from_dict
from hybridflow.models import build_tiny_model, build_tiny_tokenizer
from tests.unit.test_rollout_vllm import FakeLLM, fake_vllm  # noqa: F401 - the vllm stand-in fixture
from workers.generation import Generation, _engine_generate
from workers.rollout import get_rollout_engine, rollout_engine_names
from workers.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from workers.rollout.capabilities import (
    DEFAULT_CAPABILITIES,
    EngineCapabilities,
    engine_capabilities,
    weight_push,
)
from workers.rollout.hf import HFRolloutEngine
from workers.rollout.multi_turn import MultiTurnRollout
from workers.rollout.vllm import VLLMRolloutEngine

ROOT = Path(__file__).resolve().parents[2]
TOK = build_tiny_tokenizer()
EOS = TOK.eos_token_id
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/unit/conftest.py


class PlainEngine:
    """Declares nothing; its generate even takes ``progress=``, which is not passed undeclared."""

    def __init__(self) -> None:
        self.progress_passed = False

    def generate(self, prompt_ids, prompt_mask, sampling, progress=None) -> RolloutOutput:
        self.progress_passed = progress is not None
        n = prompt_ids.shape[0] * sampling.n
        ids = torch.full((n, 2), EOS, dtype=torch.int64)
        return RolloutOutput(ids, torch.ones_like(ids, dtype=torch.bool), torch.zeros(n, 2), ["stop"] * n)

    def load_weights(self, named_tensors) -> None: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    # attributes that a prober would have taken as capabilities: undeclared, they are not read
    fused_decode_reason = "a probe would report this"
    compiled_step = object()


class ProgressEngine(PlainEngine):
    capabilities = EngineCapabilities(progress=True)


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(len(TOK), hidden_size=32, layers=2, seed=0).eval()


# ---- the declaration itself ----------------------------------------------------------------------
def test_defaults_are_an_engine_that_declares_nothing():
    caps = engine_capabilities(PlainEngine())
    assert caps is DEFAULT_CAPABILITIES and caps == EngineCapabilities()
    assert not (caps.continuing_kv or caps.progress or caps.compiled_step or caps.fused_decode
                or caps.partial_rollout_interrupt or caps.lora or caps.shares_module)  # fmt: skip
    assert caps.weight_sync == frozenset({"full_state_dict"})
    assert isinstance(PlainEngine(), RolloutEngine)  # declaring nothing still satisfies the protocol


def test_invalid_declarations_raise():
    with pytest.raises(ValueError, match="one or more"):
        EngineCapabilities(weight_sync=frozenset())
    with pytest.raises(ValueError, match="one or more"):
        EngineCapabilities(weight_sync=frozenset({"pickle"}))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs lora"):
        EngineCapabilities(weight_sync=frozenset({"lora_adapter"}))
    with pytest.raises(ValueError, match="needs partial_rollout_interrupt"):
        EngineCapabilities(partial_rollout_pause=True)
    with pytest.raises(TypeError, match="not EngineCapabilities"):
        engine_capabilities(type("Bad", (), {"capabilities": {"progress": True}})())
    with pytest.raises(AttributeError):  # frozen
        DEFAULT_CAPABILITIES.progress = True  # type: ignore[misc]


@pytest.mark.parametrize(
    ("modes", "lora", "expected"),
    [
        ({"shared_module", "full_state_dict"}, True, "none"),
        ({"shared_module", "full_state_dict"}, False, "none"),
        ({"full_state_dict", "lora_adapter"}, True, "lora_adapter"),
        ({"full_state_dict", "lora_adapter"}, False, "full_state_dict"),
        ({"full_state_dict"}, True, "full_state_dict"),
    ],
)
def test_weight_push_decision(modes, lora, expected):
    caps = EngineCapabilities(weight_sync=frozenset(modes), lora="lora_adapter" in modes)
    assert weight_push(caps, lora=lora) == expected


def test_weight_push_refuses_an_engine_that_takes_no_full_state_dict_without_lora():
    with pytest.raises(ValueError, match="full state dict"):
        weight_push(EngineCapabilities(weight_sync=frozenset({"lora_adapter"}), lora=True), lora=False)


# ---- each engine's declaration is what it really supports ----------------------------------------
def test_every_registered_engine_declares_what_its_methods_offer():
    for name in rollout_engine_names():
        cls = get_rollout_engine(name)
        caps = engine_capabilities(cls)
        assert ("progress" in inspect.signature(cls.generate).parameters) == caps.progress, name
        assert callable(getattr(cls, "generate_continuing", None)) == caps.continuing_kv, name
        assert callable(getattr(cls, "load_lora_adapter", None)) == ("lora_adapter" in caps.weight_sync), name
        assert callable(getattr(cls, "load_weights", None)) == ("full_state_dict" in caps.weight_sync), name
        assert ("interrupt" in inspect.signature(cls.generate).parameters) == caps.partial_rollout_interrupt, name
        assert ("pause" in inspect.signature(cls.generate).parameters) == caps.partial_rollout_pause, name


def test_the_configs_partial_modes_are_what_each_engine_declares():
    """hybridflow.config cannot import workers/: its table of rollout.partial modes mirrors the engines'."""
    from hybridflow.config.experiment import STREAM_PARTIAL_MODES

    assert set(STREAM_PARTIAL_MODES) == set(rollout_engine_names())
    for name in rollout_engine_names():
        assert STREAM_PARTIAL_MODES[name] == engine_capabilities(get_rollout_engine(name)).partial_modes, name
    assert "pause" in STREAM_PARTIAL_MODES["hf"] and "pause" in STREAM_PARTIAL_MODES["vllm"]


def test_hf_engine_declaration_holds(model):
    engine = HFRolloutEngine(model, TOK, generation_batch_trajectories=2)
    caps = engine_capabilities(engine)
    assert caps == HFRolloutEngine.capabilities and caps.shares_module and caps.lora
    assert engine.model is model  # "shared_module": it generates on the module it was built with
    assert engine.compiled_step is None and engine.fused_decode_reason == "no call yet"
    enc = TOK(["hi", "abc"], return_tensors="pt", padding=True)
    ticks = []
    sampling = SamplingParams(max_new_tokens=4, stop_token_ids=(EOS,), n=2, seed=1)
    out = engine.generate(enc["input_ids"], enc["attention_mask"].bool(), sampling,
                          progress=lambda d, t: ticks.append((d, t)))  # fmt: skip
    assert len(out) == 4 and ticks[-1] == (4, 4) and len(ticks) >= 2  # a tick per chunk at least
    assert engine.fused_decode_reason is None or isinstance(engine.fused_decode_reason, str)
    seqs = [TOK("hi", add_special_tokens=False)["input_ids"], TOK("abc", add_special_tokens=False)["input_ids"]]
    one = SamplingParams(max_new_tokens=3, stop_token_ids=(EOS,), seed=2)
    first, caches = engine.generate_continuing(seqs, [None, None], one)
    assert len(first) == 2 and len(caches) == 2
    longer = [s + first.response_ids[r][first.response_mask[r]].tolist() for r, s in enumerate(seqs)]
    again, _ = engine.generate_continuing(longer, caches, one)  # continues the KV of the last turn
    assert len(again) == 2


def test_hf_engine_shares_a_lora_module_and_generates_with_its_adapter(model):
    from hybridflow.config import ModelConfig
    from hybridflow.models import apply_lora

    lora_model = apply_lora(build_tiny_model(len(TOK), hidden_size=32, layers=2, seed=0),
                            ModelConfig(path="tiny", lora_rank=4)).eval()  # fmt: skip
    engine = HFRolloutEngine(lora_model, TOK)
    assert weight_push(engine_capabilities(engine), lora=True) == "none" and engine.model is lora_model
    enc = TOK(["hi"], return_tensors="pt")
    out = engine.generate(enc["input_ids"], enc["attention_mask"].bool(),
                          SamplingParams(max_new_tokens=3, temperature=0, stop_token_ids=(EOS,)))  # fmt: skip
    assert len(out) == 1


def test_vllm_engine_declaration_holds(fake_vllm, tmp_path):  # noqa: F811
    from hybridflow.config import ModelConfig, RolloutConfig
    from hybridflow.models import save_hf_checkpoint

    caps = engine_capabilities(VLLMRolloutEngine)
    assert caps.partial_rollout_interrupt and caps.partial_rollout_pause
    assert not (caps.progress or caps.continuing_kv or caps.compiled_step or caps.fused_decode or caps.shares_module)
    assert caps.lora and weight_push(caps, lora=True) == "lora_adapter"
    assert weight_push(caps, lora=False) == "full_state_dict"
    folder = save_hf_checkpoint(build_tiny_model(len(TOK)), TOK, tmp_path / "policy")
    engine = VLLMRolloutEngine.from_config(tokenizer=TOK, model_cfg=ModelConfig(path=str(folder), lora_rank=4),
                                           rollout_cfg=RolloutConfig(), max_model_len=64, seed=0)  # fmt: skip
    assert engine.llm.kwargs["enable_lora"] is True  # "lora": built to take adapters
    assert isinstance(engine.llm, FakeLLM)


# ---- callers read the declaration ----------------------------------------------------------------
def test_undeclared_engine_gets_progress_once_at_the_end_as_before():
    engine, ticks = PlainEngine(), []
    out = _engine_generate(engine, torch.ones(3, 2, dtype=torch.int64), torch.ones(3, 2, dtype=torch.bool),
                           SamplingParams(max_new_tokens=2, n=2), lambda d, t: ticks.append((d, t)))  # fmt: skip
    assert len(out) == 6 and ticks == [(6, 6)] and not engine.progress_passed


def test_engine_declaring_progress_gets_the_callback():
    engine, ticks = ProgressEngine(), []
    _engine_generate(engine, torch.ones(1, 2, dtype=torch.int64), torch.ones(1, 2, dtype=torch.bool),
                     SamplingParams(max_new_tokens=2), lambda d, t: ticks.append((d, t)))  # fmt: skip
    assert engine.progress_passed and ticks == []  # the engine reports (this stand-in does not)


def _generation(engine):
    worker = Generation()
    worker.engine, worker.rank = engine, 0
    return worker


def test_engine_metrics_follow_the_declaration(model):
    assert _generation(PlainEngine())._engine_metrics() == {}  # undeclared attributes are not read
    hf = HFRolloutEngine(model, TOK)
    hf.fused_decode_reason = None
    assert _generation(hf)._engine_metrics() == {"rollout/fused_decode": 1.0}  # no compiled step: none set
    hf.fused_decode_reason = "why not"
    assert _generation(hf)._engine_metrics() == {"rollout/fused_decode": 0.0}


def test_multi_turn_continues_kv_only_where_declared(model):
    cfg = config_from_dict({"rollout": {"environment": "tests.unit.agent_fixtures:AsyncEchoEnv",
                                        "multi_turn": {"kv_cache": True}}}).rollout  # fmt: skip
    assert MultiTurnRollout(HFRolloutEngine(model, TOK), TOK, cfg, None).continue_kv
    assert not MultiTurnRollout(PlainEngine(), TOK, cfg, None).continue_kv
    off = config_from_dict({"rollout": {"environment": "tests.unit.agent_fixtures:AsyncEchoEnv",
                                        "multi_turn": {"kv_cache": False}}}).rollout  # fmt: skip
    assert not MultiTurnRollout(HFRolloutEngine(model, TOK), TOK, off, None).continue_kv


# ---- no probes of engines in workers/, tasks/, flows/ --------------------------------------------
ALLOWED = {("workers/rollout/capabilities.py", "getattr")}  # engine_capabilities: reads the declaration


def _mentions_engine(node: ast.AST) -> bool:
    """The expression names an engine: a name or attribute containing "engine"."""
    for sub in ast.walk(node):
        name = sub.id if isinstance(sub, ast.Name) else sub.attr if isinstance(sub, ast.Attribute) else ""
        if "engine" in name.lower():
            return True
    return False


def engine_probes(source: str, path: str = "<string>") -> list[str]:
    """``hasattr(<engine>, …)``, ``getattr(<engine>, "<name>"…)`` and ``inspect.signature(<engine>…)``
    calls in ``source``, as "path:line: text"."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        f = node.func
        kind = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        if kind not in ("hasattr", "getattr", "signature") or not _mentions_engine(node.args[0]):
            continue
        if (path, kind) in ALLOWED:
            continue
        found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_engine_probes_in_workers_tasks_flows():
    found = []
    for top in ("workers", "tasks", "flows"):
        for file in sorted((ROOT / top).rglob("*.py")):
            rel = file.relative_to(ROOT).as_posix()
            found += engine_probes(file.read_text(), rel)
    assert not found, "engine capabilities are declared (workers/rollout/capabilities.py), not probed:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "planted",
    [
        "hasattr(engine, 'generate_continuing')",
        "x = hasattr(self.engine, 'load_lora_adapter')",
        "getattr(self.engine, 'compiled_step', None)",
        "getattr(self.engine, 'model', None) is module",
        "inspect.signature(engine.generate).parameters",
        "from inspect import signature\nsignature(self.rollout_engine.generate)",
    ],
)
def test_planted_probe_is_caught(tmp_path, planted):
    module = tmp_path / "planted.py"
    module.write_text(f"import inspect\n{planted}\n")
    assert engine_probes(module.read_text(), "workers/planted.py")


def test_other_probes_are_not_engine_probes():
    assert not engine_probes("hasattr(model, 'get_base_model')\ninspect.signature(fn)\ngetattr(out, 'metrics', {})\n")
