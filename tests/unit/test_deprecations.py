"""Each deprecated name warns with a FutureWarning (shown by default) naming its replacement and the
removal version, and still works until then."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from hybridflow.deprecation import (
    REMOVAL_VERSION,
    deprecated_attributes,
    deprecation_message,
    warn_deprecated,
)
from tests.unit._worker_helpers import tiny_cfg

REMOVED = r"will be removed in hybridflow 0\.3\.0"


def test_message_and_category():
    assert REMOVAL_VERSION == "0.3.0"
    assert deprecation_message("a", "b") == "a is deprecated and will be removed in hybridflow 0.3.0; use b"

    def deprecated_thing():
        warn_deprecated("old", "new")

    with pytest.warns(FutureWarning, match=f"old is deprecated and {REMOVED}; use new") as caught:
        deprecated_thing()  # stacklevel 2: the warning blames this line, the user of the deprecated thing
    assert caught[0].filename == __file__ and caught[0].lineno == deprecated_thing.__code__.co_firstlineno + 4


def test_a_future_warning_is_shown_by_default():
    """No -W flag, no filter: a plain `python` (as the CLI runs) prints it; a DeprecationWarning would not be."""
    code = "from hybridflow.deprecation import warn_deprecated\ndef f():\n    warn_deprecated('x', 'y')\nf()\n"
    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root,
                         env={"PYTHONPATH": root})  # no PYTHONWARNINGS
    assert "FutureWarning: x is deprecated and will be removed in hybridflow 0.3.0; use y" in out.stderr


def test_deprecated_module_attribute():
    getattr_ = deprecated_attributes("pkg.mod", {"OLD": ("pkg.mod.NEW", lambda: 5)})
    with pytest.warns(FutureWarning, match=f"pkg.mod.OLD is deprecated and {REMOVED}; use pkg.mod.NEW"):
        assert getattr_("OLD") == 5
    with pytest.raises(AttributeError, match="has no attribute 'OTHER'"):
        getattr_("OTHER")


def test_step_prefix():
    import workers.checkpoint as C

    with pytest.warns(FutureWarning, match=f"workers.checkpoint.STEP_PREFIX is deprecated and {REMOVED}; "
                                           "use workers.checkpoint.LEGACY_PREFIX"):
        from workers.checkpoint import STEP_PREFIX
    assert STEP_PREFIX == C.LEGACY_PREFIX == "step_"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert C.LEGACY_PREFIX == "step_" and C.CHECKPOINT_PREFIX == "iter_"  # the replacements do not warn


def test_prompts_per_step_property():
    cfg = tiny_cfg()
    with pytest.warns(FutureWarning, match=f"DataConfig.prompts_per_step is deprecated and {REMOVED}; "
                                           "use DataConfig.prompts_per_iteration"):
        assert cfg.data.prompts_per_step == cfg.data.prompts_per_iteration


def test_prompts_per_step_config_key():
    from hybridflow.config import load_config

    with pytest.warns(FutureWarning, match=f"config key data.prompts_per_step is deprecated and {REMOVED}; "
                                           "use data.prompts_per_iteration"):
        assert load_config(None, ["data.prompts_per_step=4"]).data.prompts_per_iteration == 4


def test_model_dtype_config_key():
    from hybridflow.config import load_config

    with pytest.warns(FutureWarning, match=f"config key model.dtype is deprecated and {REMOVED}; "
                                           "use model.precision: bf16-true"):
        assert load_config(None, ["model.dtype=bfloat16"]).model.precision == "bf16-true"


def test_builtin_nodes():
    from flows.iteration import builtin_dataflow, builtin_nodes

    cfg = tiny_cfg()
    with pytest.warns(FutureWarning, match=rf"flows.iteration.builtin_nodes\(cfg\) is deprecated and {REMOVED}; "
                                           r"use flows.iteration.builtin_dataflow\(cfg\)"):
        nodes = builtin_nodes(cfg)
    assert [n.name for n in nodes] == [n.name for n in builtin_dataflow(cfg).nodes]


def test_node_overrides():
    from flows.dataflow import DataFlow
    from hybridflow.batch import Batch
    from tasks.node import node

    @node
    def gen(run, prompts: Batch) -> Batch: ...

    with pytest.warns(FutureWarning, match=rf"node 'keep': @node\(overrides=...\) is deprecated and {REMOVED}; "
                                           r"use DataFlow.rewire\(consumer, param=node\)"):
        @node(name="keep", overrides=("gen",))
        def keep(run, gen: Batch) -> Batch: ...

    @node
    def use(run, gen: Batch) -> Batch: ...

    with pytest.warns(FutureWarning, match=rf"@node\(overrides=...\) \(nodes keep\) is deprecated and {REMOVED}"):
        df = DataFlow([gen, keep, use], inputs=("prompts",))
    assert df.wiring["use"]["gen"] == "keep"  # still honoured


def test_pool_call(monkeypatch):
    import workers.pool as P

    seen = []
    monkeypatch.setattr(P, "call_ranks", lambda pool, role, method, proto, args, kwargs, timeout_s: seen.append(
        (role, method, proto.name, args, kwargs, timeout_s)) or "joined")
    pool = P.Pool("main", "ns", actors=[], roles=("policy",))
    with pytest.warns(FutureWarning, match=rf"Pool.call\('policy', 'compute_log_probs', ...\) is deprecated and "
                                           rf"{REMOVED}; use pool.role\('policy'\).compute_log_probs\(...\)"):
        assert pool.call("policy", "compute_log_probs", 1, timeout_s=3.0, x=2) == "joined"
    assert seen == [("policy", "compute_log_probs", "dp_scatter", (1,), {"x": 2}, 3.0)]
