"""Output caps before work (issue 40, defect 3): a tool's 10 MB output is cut to a byte budget in the
worker that made it (UTF-8 boundary, head and tail around the marker), before it is templated,
tokenized, stored or logged; the cut counts in ``tool/truncated``; the stored conversation holds
what the model saw."""

from __future__ import annotations

import time

import pytest

from hybridflow.agents.caps import TRUNCATION_MARKER, cap_output, cut_middle_bytes, observation_byte_budget
from hybridflow.agents.remote import EnvCall, EnvRunner
from hybridflow.agents.render import ChatRenderer
from tests.unit.test_rollout_multi_turn import TOK, ScriptedEngine, call, ids, rollout, segments

FIX = "tests.unit.agent_fixtures"


def test_cut_keeps_head_and_tail_at_character_boundaries():
    marker = "|"
    assert cut_middle_bytes("abcdef", 6, marker) == "abcdef"  # fits: unchanged
    assert cut_middle_bytes("abcdefgh", 5, marker) == "ab|gh"  # 5 - 1 marker byte = 4 kept: 2 head, 2 tail
    assert cut_middle_bytes("abcdefgh", 6, marker) == "ab|fgh"  # the tail gets the odd byte
    # "é" is 2 bytes, "€" 3: 8 kept bytes = 4 head + 4 tail; "éé" fills the head, the tail's first
    # 4 bytes of "€€" are one whole "€" plus 1 byte of the other: the split character is dropped
    assert cut_middle_bytes("éé" + "x" * 10 + "€€", 9, marker) == "éé|€"
    text = "€" * 1000
    cut = cut_middle_bytes(text, 100)
    assert len(cut.encode()) <= 100 and TRUNCATION_MARKER in cut and set(cut.replace(TRUNCATION_MARKER, "")) == {"€"}


def test_prints_are_capped(capsys):
    from hybridflow.agents.caps import capped_prints

    with capped_prints(10):
        print("x" * 100)
        print("more")
    out = capsys.readouterr().out
    assert out.startswith("x" * 10) and out.count("[truncated]") == 1 and "more" not in out and len(out) < 80


def test_cap_output_cuts_strings_and_message_contents():
    msgs = [{"role": "tool", "name": "t", "content": "x" * 50}, {"role": "tool", "name": "u", "content": "short"}]
    out, n = cap_output(msgs, 30)
    assert n == 1 and len(out[0]["content"]) <= 30 and out[1] == msgs[1] and msgs[0]["content"] == "x" * 50
    assert cap_output("y" * 40, 30)[1] == 1 and cap_output(None, 30) == (None, 0)
    assert observation_byte_budget(256) == 4096


@pytest.fixture(scope="module")
def runner():
    r = EnvRunner(num_workers=1, timeout_s=20.0)
    yield r
    r.close()


def test_the_worker_cuts_before_it_sends(runner):
    state = runner.run([EnvCall.reset("tools", {"tools": [f"{FIX}:flood"]}, {"prompt": []}, 4096)])[0].result.state
    text = call("flood", x=1)
    res = runner.run([EnvCall.step("tools", state, text, 4096)])[0].result
    content = res.observation[0]["content"]
    assert res.truncated == 1 and len(content.encode()) <= 4096 and TRUNCATION_MARKER in content
    assert content.startswith("head-é") and content.endswith("-tail")


def test_a_10_mb_tool_output_is_cut_before_templating_and_stored_as_seen(runner):
    cfg = {"tools": [f"{FIX}:flood"], "max_response_tokens": 400, "multi_turn": {"max_observation_tokens": 64}}
    start = time.monotonic()
    out = rollout(runner, ScriptedEngine({"Q": [call("flood", x=1), "done"]}), cfg, ["Q"])
    assert time.monotonic() - start < 30  # the 10 MB are never templated or tokenized here
    assert out.metrics["tool/truncated"] == 1 and out.metrics["tool/calls/mean"] == 1
    stored = out.non_tensors["messages"][0]
    tool_msg = next(m for m in stored if m["role"] == "tool")
    assert len(tool_msg["content"].encode()) <= observation_byte_budget(64) and TRUNCATION_MARKER in tool_msg["content"]
    # what the model saw: the observation tokens in the response are the rendering of the stored message
    segs = segments(out.response_mask[0].tolist())
    start_obs = segs[0][1] + 1  # after the first turn and the "\n" closing it
    seen = out.response_ids[0, start_obs : segs[0][1] + segs[1][1]].tolist()
    assert len(seen) == 64 and seen == ChatRenderer(TOK).observation_ids([tool_msg])
    assert tool_msg["content"].startswith("head") and tool_msg["content"].endswith("tail")


def test_small_outputs_are_untouched(runner):
    out = rollout(runner, ScriptedEngine({"Q": [call("add", a=2, b=3), "ok"]}),
                  {"tools": [f"{FIX}:add"], "max_response_tokens": 200}, ["Q"])  # fmt: skip
    assert out.metrics["tool/truncated"] == 0
    assert {"role": "tool", "name": "add", "content": "5"} in out.non_tensors["messages"][0]
    assert ids("5")[0] in out.response_ids[0].tolist()
