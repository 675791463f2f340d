"""bench/common.py helpers and the `hybridflow bench` subcommand (no timing is asserted)."""

from __future__ import annotations

import argparse

import pytest

from bench import common
from flows.cli import bench as cli_bench


def test_stats_min_median_max():
    # sorted 1, 2, 10 → median 2
    assert common.stats([10.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 10.0, "n": 3}
    with pytest.raises(ValueError):
        common.stats([])


def test_alternate_interleaves_abba_and_warms_up():
    calls: list[str] = []

    def side(name: str, value: float):
        def f():
            calls.append(name)
            return value

        return f

    got = common.alternate({"a": side("a", 1.0), "b": side("b", 2.0)}, repeats=3)
    # warm-up a b, then a b | b a | a b
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert got == {"a": [1.0, 1.0, 1.0], "b": [2.0, 2.0, 2.0]}


def test_alternate_times_a_side_that_returns_none():
    got = common.alternate({"x": lambda: None}, repeats=2, warmup=False)
    assert len(got["x"]) == 2 and all(isinstance(t, float) and t >= 0 for t in got["x"])


def test_markdown_table():
    text = common.markdown_table(["a", "b"], [(1, "x")])
    assert text.splitlines() == ["| a | b |", "|---|---:|", "| 1 | x |"]


def test_update_docs_section_replaces_only_its_block(tmp_path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\nintro\n")
    common.update_docs_section("peak", "table v1", docs)
    common.update_docs_section("train", "train v1", docs)
    text = docs.read_text()
    assert "## peak\n\n<!-- bench:peak:begin -->\ntable v1\n<!-- bench:peak:end -->" in text
    docs.write_text(text.replace("intro", "intro\n\nanalysis written by hand"))
    common.update_docs_section("peak", "table v2", docs)
    text = docs.read_text()
    assert "table v2" in text and "table v1" not in text
    assert "analysis written by hand" in text and "train v1" in text
    assert text.count("<!-- bench:peak:begin -->") == 1


def test_model_flops_per_token_tiny_model():
    from hybridflow.models import build_tiny_model

    model = build_tiny_model(100, hidden_size=32, layers=2, seed=0)  # 4 heads of 8, 2 KV heads, MLP 64, tied
    f = common.model_flops_per_token(model)
    # matrices: embedding/LM head 100·32 = 3200; per layer q 32·32 + k 16·32 + v 16·32 + o 32·32 = 3072,
    # gate + up + down 3·64·32 = 6144 → 9216 per layer; N = 3200 + 2·9216 = 21632; dense = 2N
    assert f["dense"] == 2 * 21632
    # QKᵀ and AV: 4 · layers 2 · heads 4 · head_dim 8 = 256 FLOPs per context position
    assert f["attn_per_ctx"] == 256


def test_cli_bench_lists_and_rejects_unknown(capsys):
    names = cli_bench.available()
    for name in ("peak", "rollout", "train", "e2e", "overhead", "algorithms"):
        assert name in names
    assert "common" not in names and "harness" not in names
    assert cli_bench.run(argparse.Namespace(name="nope", args=[])) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err
    assert cli_bench.run(argparse.Namespace(name="list", args=[])) == 0
    assert "rollout" in capsys.readouterr().out.split()


def test_cli_bench_parses_remainder():
    from flows.cli import build_parser

    args = build_parser().parse_args(["bench", "peak", "--tokens", "8", "--no-docs"])
    assert args.name == "peak" and args.args == ["--tokens", "8", "--no-docs"]


def test_cli_bench_runs_with_the_pools_allocator_unless_told_otherwise(tmp_path):
    """``hybridflow bench`` re-executes itself with the pools' glibc malloc settings (results record
    ``environment.allocator``); ``--allocator default`` leaves glibc's defaults."""
    import json
    import os
    import subprocess
    import sys

    from workers.allocator import KEEP_FREED_MEMORY_ENV

    env = {k: v for k, v in os.environ.items() if k not in KEEP_FREED_MEMORY_ENV}
    got = {}
    for allocator in ("keep-freed", "default"):
        out = tmp_path / f"{allocator}.json"
        cmd = [sys.executable, "-m", "flows.cli", "bench", "--allocator", allocator, "peak", "--tokens", "8",
               "--repeats", "1", "--bandwidth-mb", "8", "--square", "64", "--no-docs", "--out", str(out)]
        subprocess.run(cmd, check=True, env=env, timeout=120, capture_output=True)
        got[allocator] = json.loads(out.read_text())["environment"]["allocator"]
    assert got == {"keep-freed": "keep-freed", "default": "default"}
    # --allocator default removes the settings when the caller's environment has them
    out = tmp_path / "default_over_set.json"
    cmd = [sys.executable, "-m", "flows.cli", "bench", "--allocator", "default", "peak", "--tokens", "8",
           "--repeats", "1", "--bandwidth-mb", "8", "--square", "64", "--no-docs", "--out", str(out)]
    subprocess.run(cmd, check=True, env=env | KEEP_FREED_MEMORY_ENV, timeout=120, capture_output=True)
    assert json.loads(out.read_text())["environment"]["allocator"] == "default"
    # called in-process (flows.cli.main(argv)), the command never replaces its caller's process
    from flows.cli import main

    out = tmp_path / "in_process.json"
    argv = ["bench", "--allocator", "keep-freed", "peak", "--tokens", "8", "--repeats", "1", "--bandwidth-mb", "8",
            "--square", "64", "--no-docs", "--out", str(out)]
    assert main(argv) == 0
    assert json.loads(out.read_text())["environment"]["allocator"] == common.allocator()
    assert common.allocator() in ("keep-freed", "default")
    assert "glibc malloc: keep-freed." in common.measured_under(common.environment() | {"allocator": "keep-freed"})
