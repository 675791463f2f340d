"""Smoke runs of the micro-benchmarks on a tiny random model and tiny sizes: they run, write the
JSON they promise and render their table. No speed is asserted (benchmarks are not tests)."""

from __future__ import annotations

import json

import pytest
import torch

from bench import lm_head, peak, rollout, train


def test_peak_smoke(tmp_path):
    out = tmp_path / "peak.json"
    assert peak.main(["--tokens", "4", "--repeats", "1", "--bandwidth-mb", "1", "--square", "64", "--out", str(out), "--no-docs"]) == 0
    res = json.loads(out.read_text())
    assert [r["shape"] for r in res["matmul"]][-1] == "square 64³"
    assert all(r["gflops"] > 0 for r in res["matmul"])
    assert res["peak_gflops"] == max(r["gflops"] for r in res["matmul"])
    assert res["bandwidth"]["bytes"] == 1 << 20 and res["bandwidth"]["read_gbs"] > 0
    assert "load average" in peak.render(res)


def test_model_mix_is_the_flop_weighted_harmonic_mean():
    rows = [{"m": 1, "k": 1, "n": 1, "count": 1, "gflops": 10.0},   # 2 FLOPs at 10 GFLOP/s: 0.2 ns
            {"m": 1, "k": 1, "n": 3, "count": 1, "gflops": 30.0},   # 6 FLOPs at 30 GFLOP/s: 0.2 ns
            {"m": 9, "k": 9, "n": 9, "count": 0, "gflops": 99.0}]   # not a model shape: ignored
    # 8 FLOPs in 0.4 ns = 20 GFLOP/s
    assert peak.model_mix(rows) == pytest.approx(20.0)


def test_decode_limit_is_the_slower_of_bandwidth_and_compute():
    from hybridflow.models import build_tiny_model

    model = build_tiny_model(100, hidden_size=32, layers=2, seed=0)
    weight_bytes = 21792 * 4  # every parameter, float32
    peak_res = {"bandwidth": {"read_gbs": 1.0}, "peak_gflops": 1.0}
    # batch 1: read 87168 B at 1 GB/s = 87.168 µs; compute 43264 FLOPs at 1 GFLOP/s = 43.264 µs → bandwidth bound
    assert rollout.decode_limit(model, 1, peak_res) == pytest.approx(1 / (weight_bytes / 1e9))
    # batch 4: compute 4·43264 = 173056 FLOPs = 173.056 µs > 87.168 µs → compute bound, 4 tokens per step
    assert rollout.decode_limit(model, 4, peak_res) == pytest.approx(4 / (4 * 43264 / 1e9))
    assert rollout.decode_limit(model, 4, None) is None
    # a call of 4 rows × 2 tokens after a 3-token prompt: 2 compute-bound steps (2 · 173.056 µs) and a
    # prefill of 4 · 2 positions at (43264 − 2 · 100 · 32 = 36864) FLOPs each = 294.912 µs → 8 tokens in 641.024 µs
    assert rollout.call_limit(model, 4, 2, 3, peak_res) == pytest.approx(8 / (2 * 173.056e-6 + 294.912e-6))
    assert rollout.call_limit(model, 4, 2, 3, None) is None


def test_rollout_smoke(tmp_path):
    from bench import common

    out = tmp_path / "rollout.json"
    argv = ["--model", "tiny", "--batches", "1,2", "--lengths", "3", "--repeats", "1", "--probe-size", "64",
            "--bandwidth-mb", "8", "--out", str(out), "--no-docs"]
    assert rollout.main(argv) == 0
    res = json.loads(out.read_text())
    assert [(c["batch"], c["length"]) for c in res["cells"]] == [(1, 3), (2, 3)]
    for c in res["cells"]:
        assert len(c["hf_tokens_per_s"]) == len(c["bare_tokens_per_s"]) == 1
        assert c["ratio"]["median"] == pytest.approx(c["hf_tokens_per_s"][0] / c["bare_tokens_per_s"][0])
        # the limit comes from the peak and bandwidth probed between the cell's runs
        assert c["peak_alongside_gflops"]["n"] == c["read_gbs_alongside"]["n"] == 1
        assert (c["probe_size"], c["bandwidth_mb"]) == (64, 8)
        probed = {"peak_gflops": c["peak_alongside_gflops"]["median"],
                  "bandwidth": {"read_gbs": c["read_gbs_alongside"]["median"]}}
        model, _ = common.load_model("tiny")
        assert c["decode_limit_tokens_per_s"] == pytest.approx(rollout.decode_limit(model, c["batch"], probed))
        assert c["call_limit_tokens_per_s"] < c["decode_limit_tokens_per_s"]
    assert "| 2 | 3 |" in rollout.render(res) and "(probed alongside)" in rollout.render(res)
    assert res["engine"]["fused_decode"] and "through the fused step" in rollout.render(res)


def test_rollout_smoke_in_bfloat16(tmp_path):
    """--dtype bfloat16: the hf engine decodes fused in bfloat16; the limit counts 2-byte weights."""
    from bench import common

    out = tmp_path / "rollout.json"
    argv = ["--model", "tiny", "--batches", "2", "--lengths", "3", "--repeats", "1", "--probe-size", "64",
            "--bandwidth-mb", "8", "--dtype", "bfloat16", "--out", str(out), "--no-docs"]
    assert rollout.main(argv) == 0
    res = json.loads(out.read_text())
    from workers.rollout.packed_weights import packs

    # fused in bfloat16 where this CPU's oneDNN packs it (else the engine decodes under autocast)
    assert res["dtype"] == "bfloat16" and res["engine"]["fused_decode"] == packs(torch.bfloat16)
    c = res["cells"][0]
    probed = {"peak_gflops": c["peak_alongside_gflops"]["median"],
              "bandwidth": {"read_gbs": c["read_gbs_alongside"]["median"]}}
    model, _ = common.load_model("tiny")
    assert c["decode_limit_tokens_per_s"] == pytest.approx(rollout.decode_limit(model, 2, probed, 2))
    assert "hf engine in bfloat16" in rollout.render(res)
    peak_res = {"bandwidth": {"read_gbs": 1.0}, "peak_gflops": 1e9}  # bandwidth bound: half the bytes, twice the rate
    assert rollout.decode_limit(model, 1, peak_res, 2) == pytest.approx(2 * rollout.decode_limit(model, 1, peak_res))


def test_bare_generate_makes_exactly_length_tokens():
    from bench import common

    model, tok = common.load_model("tiny")
    ids, mask = common.prompt_batch(tok, 2)
    got = rollout.bare_generate(model, ids, mask, 5, int(tok.pad_token_id), seed=0)
    assert tuple(got.shape) == (2, 5)


def test_train_flops_per_token():
    from hybridflow.models import build_tiny_model

    model = build_tiny_model(100, hidden_size=32, layers=2, seed=0)
    # 3 × (dense 43264 + attention 256 per position × mean causal context (8+1)/2 = 4.5 → 1152)
    assert train.train_flops(model, 8) == 3 * (43264 + 1152)


def test_train_smoke(tmp_path):
    out = tmp_path / "train.json"
    argv = ["--model", "tiny", "--micro", "2", "--seq", "8", "--steps", "2", "--repeats", "1", "--probe-size", "64",
            "--out", str(out), "--no-docs"]
    assert train.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["tokens_per_update"] == 2 * 2 * 8
    assert len(res["hybridflow_tokens_per_s"]) == len(res["bare_tokens_per_s"]) == 1
    assert res["hybridflow"]["median"] > 0 and res["bare"]["median"] > 0
    assert res["peak_alongside_gflops"]["n"] == 1 and res["probe_size"] == 64
    assert res["hybridflow"]["mfu_vs_peak_alongside"] > 0
    assert "update_policy" in train.render(res)


def test_train_smoke_bf16_mixed(tmp_path):
    out = tmp_path / "train.json"
    argv = ["--model", "tiny", "--micro", "2", "--seq", "8", "--steps", "1", "--repeats", "1", "--probe-size", "64",
            "--precision", "bf16-mixed", "--out", str(out), "--no-docs"]
    assert train.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["precision"]["name"] == "bf16-mixed" and res["bf16_peak_alongside_gflops"]["median"] > 0
    assert res["hybridflow"]["mfu_vs_bf16_peak_alongside"] > 0
    assert "MFU vs bf16 peak alongside" in train.render(res) and "bfloat16 median" in train.render(res)


def test_finished_rows_smoke(tmp_path):
    from bench import finished_rows

    out = tmp_path / "finished_rows.json"
    assert finished_rows.main(["--model", "tiny", "--cells", "2x3x6", "--repeats", "1", "--out", str(out), "--no-docs"]) == 0
    res = json.loads(out.read_text())
    (cell,) = res["cells"]
    assert (cell["prompts"], cell["samples"], cell["max_tokens"]) == (2, 3, 6)
    assert len(cell["seconds"]["own"]) == len(cell["seconds"]["generate"]) == 1
    # the own loop computes exactly the response tokens; generate at least as many
    assert cell["finished_share"]["own"] == 0.0
    assert cell["work"]["generate"]["row_steps"] >= cell["work"]["own"]["row_steps"]
    assert cell["identical_rows"][1] == 2 * 3 * 2  # warm-up + 1 run
    assert 0 <= cell["max_log_prob_gap_identical_rows"] < 1e-4
    assert "| 2 × 3 | 6 |" in finished_rows.render(res)


def test_compiled_decode_smoke(tmp_path):
    from bench import compiled_decode

    out = tmp_path / "compiled_decode.json"
    assert compiled_decode.main(["--model", "tiny", "--cells", "2x3x6", "--repeats", "1", "--out", str(out), "--no-docs"]) == 0
    (cell,) = json.loads(out.read_text())["cells"]
    assert len(cell["seconds"]["eager"]) == len(cell["seconds"]["compiled"]) == 1
    assert cell["compiles"] >= 1 and cell["compile_seconds"] > 0 and cell["first_call_rows"] == 6
    assert cell["greedy_identical_rows"] == [6, 6] and cell["greedy_max_log_prob_gap"] < 1e-5
    assert cell["identical_rows"][1] == 6 and cell["max_log_prob_gap_identical_rows"] < 1e-4
    assert "| 2 × 3 | 6 |" in compiled_decode.render(json.loads(out.read_text()))


def test_packed_weights_smoke(tmp_path):
    from bench import packed_weights

    out = tmp_path / "packed_weights.json"
    assert packed_weights.main(["--model", "tiny", "--cells", "2x3x6", "--repeats", "2", "--out", str(out), "--no-docs"]) == 0
    (cell,) = json.loads(out.read_text())["cells"]
    assert len(cell["seconds"]["unpacked"]) == len(cell["seconds"]["packed"]) == 2
    assert cell["packed_linears"] > 0  # the tiny Llama's projections and LM head
    assert cell["greedy_identical_rows"] == [6, 6] and cell["greedy_max_log_prob_gap"] < 1e-4
    assert cell["identical_rows"][1] == 2 * 6 and cell["max_log_prob_gap_identical_rows"] < 1e-4
    assert "| 2 × 3 | 6 |" in packed_weights.render(json.loads(out.read_text()))


def test_fused_decode_smoke(tmp_path):
    from bench import fused_decode

    out = tmp_path / "fused_decode.json"
    assert fused_decode.main(["--model", "tiny", "--cells", "2x3x6", "--repeats", "2", "--out", str(out), "--no-docs"]) == 0
    (cell,) = json.loads(out.read_text())["cells"]
    assert len(cell["seconds"]["forward"]) == len(cell["seconds"]["fused"]) == 2
    ratios = [f / g for f, g in zip(cell["seconds"]["forward"], cell["seconds"]["fused"], strict=True)]
    assert cell["speedup"]["min"] == pytest.approx(min(ratios)) and cell["speedup"]["max"] == pytest.approx(max(ratios))
    assert cell["greedy_identical_rows"] == [6, 6] and cell["greedy_max_log_prob_gap"] < 1e-4
    assert cell["identical_rows"][1] == 2 * 6 and cell["max_log_prob_gap_identical_rows"] < 1e-4
    assert "| 2 × 3 | 6 |" in fused_decode.render(json.loads(out.read_text()))


def test_cell_benchmarks_reject_bad_cells_and_repeats(capsys):
    from bench import common, fused_decode

    assert common.parse_cells("4x8x48, 2X8x128") == [(4, 8, 48), (2, 8, 128)]
    for bad in ("2x2", "4x8x0", "axbxc", ","):
        with pytest.raises(ValueError, match="cell|names no cell"):
            common.parse_cells(bad)
    for argv, words in [(["--cells", "2x2"], "PROMPTSxSAMPLESxTOKENS"), (["--repeats", "0"], "at least 1")]:
        with pytest.raises(SystemExit) as exc:
            fused_decode.main(["--model", "tiny", "--no-docs", *argv])
        assert exc.value.code == 2 and words in capsys.readouterr().err


def test_lm_head_smoke(tmp_path):
    out = tmp_path / "lm_head.json"
    argv = ["--model", "tiny", "--micro", "2", "--seq", "8", "--repeats", "1", "--out", str(out), "--no-docs"]
    assert lm_head.main(argv) == 0
    res = json.loads(out.read_text())
    for side in ("chunked", "full"):  # one subprocess per side, each with its own peak RSS
        assert len(res["runs"][side]) == 1
        run = res["runs"][side][0]
        assert run["tokens_per_s"] > 0 and run["peak_rss_mb"] >= run["rss_before_update_mb"] > 0
    assert "chunked" in lm_head.render(res)


def test_pack_rows_smoke(tmp_path):
    from bench import pack_rows

    out = tmp_path / "pack_rows.json"
    assert pack_rows.main(["--model", "tiny", "--cells", "2x3x6", "--repeats", "1", "--out", str(out), "--no-docs"]) == 0
    (cell,) = json.loads(out.read_text())["cells"]
    assert all(len(cell["seconds"][s]) == 1 for s in ("off", "on", "auto"))
    pos = cell["positions"]
    # packing computes at least the real tokens; auto never computes more than off
    assert pos["on"] >= cell["real_tokens"] and pos["auto"] <= pos["off"]
    assert "| 2 × 3 | 6 |" in pack_rows.render(json.loads(out.read_text()))


def test_rollout_dtypes_smoke(tmp_path):
    """--dtypes float32,bfloat16: one hf engine per dtype alternating, each with its own limit."""
    from bench import common

    out = tmp_path / "rollout_dtype.json"
    argv = ["--model", "tiny", "--batches", "2,3", "--lengths", "3", "--repeats", "2", "--probe-size", "64",
            "--bandwidth-mb", "8", "--dtypes", "float32,bfloat16", "--out", str(out), "--no-docs"]
    assert rollout.main(argv) == 0  # dispatched to bench/rollout_dtype.py
    res = json.loads(out.read_text())
    assert res["dtypes"] == ["float32", "bfloat16"] and [c["batch"] for c in res["cells"]] == [2, 3]
    from workers.rollout.packed_weights import packs

    assert res["engines"]["float32"]["fused_decode"] and res["engines"]["bfloat16"]["fused_decode"] == packs(torch.bfloat16)
    model, _ = common.load_model("tiny")
    for c in res["cells"]:
        f32, bf16 = c["dtypes"]["float32"], c["dtypes"]["bfloat16"]
        assert len(f32["tokens_per_s"]) == len(bf16["tokens_per_s"]) == 2
        ratios = [b / a for a, b in zip(f32["tokens_per_s"], bf16["tokens_per_s"], strict=True)]
        assert c["ratios"]["bfloat16/float32"]["median"] == pytest.approx(sorted(ratios)[0] / 2 + sorted(ratios)[1] / 2)
        for d, nbytes in (("float32", 4), ("bfloat16", 2)):
            probed = {"peak_gflops": c["dtypes"][d]["peak_alongside_gflops"]["median"],
                      "bandwidth": {"read_gbs": c["read_gbs_alongside"]["median"]}}
            assert c["dtypes"][d]["decode_limit_tokens_per_s"] == pytest.approx(
                rollout.decode_limit(model, c["batch"], probed, nbytes))
    from bench import rollout_dtype

    text = rollout_dtype.render(res)
    assert "| 2 | 3 |" in text and "bfloat16 ÷ float32" in text


def test_rollout_dtypes_refuses_one_dtype():
    from bench import rollout_dtype

    with pytest.raises(SystemExit):
        rollout_dtype.main(["--dtypes", "bfloat16", "--no-docs"])


def test_stream_chunks_smoke(tmp_path):
    """bench/stream_chunks.py on the tiny model: every setting generates the same groups; smaller
    chunks need more engine calls and prefill more tokens (prompt + prefix again each chunk)."""
    from bench import stream_chunks

    out = tmp_path / "sc.json"
    assert stream_chunks.main(["--model", "tiny", "--groups", "2", "--samples", "2", "--tokens", "12", "--chunks",
                               "3,6,12", "--repeats", "1", "--out", str(out), "--no-docs"]) == 0
    res = json.loads(out.read_text())
    s = res["settings"]
    # 12 is the whole response: not a partial setting
    assert list(s) == ["chunk 3", "chunk 6", "chunk 3, interruptible", "chunk 6, interruptible", "whole"]
    assert s["whole"]["calls"] == 1 and s["whole"]["wall_ratio_to_whole"] == 1.0
    assert s["chunk 3"]["calls"] >= s["chunk 6"]["calls"] >= 1
    assert s["chunk 3"]["prefill_tokens"] > s["whole"]["prefill_tokens"]
    for c in (3, 6):  # no newer weights ever arrive: one call, the prompts prefilled once, as whole
        assert s[f"chunk {c}, interruptible"]["calls"] == 1
        assert s[f"chunk {c}, interruptible"]["prefill_tokens"] == s["whole"]["prefill_tokens"]
    assert "÷ whole" in stream_chunks.render(res)
