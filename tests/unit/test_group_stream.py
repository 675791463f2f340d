"""The streaming rollout's generator (workers/group_stream.py) on the hf engine with a tiny random
Llama: partial rollouts across a weight change keep each token's log-prob and version honest,
and the submission-order schedule does not depend on timing."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from hybridflow.algorithms.logits import log_probs_from_logits
from hybridflow.algorithms.sequences import position_ids_from_mask
from hybridflow.models import build_tiny_model, build_tiny_tokenizer
from workers.group_stream import GroupStreamer
from workers.rollout.base import SamplingParams
from workers.rollout.hf import HFRolloutEngine

TOK = build_tiny_tokenizer()
STOPS = (2, *TOK.convert_tokens_to_ids(list("abc")))
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/unit/conftest.py


def _weights(seed: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in build_tiny_model(len(TOK), hidden_size=32, layers=2, seed=seed).state_dict().items()}


W0, W1, W2 = _weights(0), _weights(1), _weights(2)


class Inbox:
    """What a rollout rank holds: published versions and the loaded one (as RolloutWorker)."""

    def __init__(self, model: torch.nn.Module, published: dict[int, dict] | None = None) -> None:
        self.model, self.loaded = model, 0
        self.published = dict(published or {0: W0})
        self.model.load_state_dict(self.published[0])
        self.lock = threading.Lock()
        self.loads: list[int] = []

    def publish(self, v: int, state: dict) -> None:
        self.published[v] = state

    def load(self, v: int) -> None:
        self.model.load_state_dict(self.published[v])
        self.loaded = v
        self.loads.append(v)

    def newest(self) -> int:
        v = max(self.published)
        if v > self.loaded:
            self.load(v)
        return self.loaded

    def exact(self, v: int) -> bool:
        if v <= self.loaded:
            return True
        if v not in self.published:
            return False
        self.load(v)
        return True


def streamer(order: str, inbox: Inbox, *, chunk: int = 4, max_new: int = 12, n: int = 3, G: int = 2,
             s: int = 1, newer_weights=None, **engine_kw) -> GroupStreamer:
    engine = HFRolloutEngine(inbox.model, TOK, generation_batch_trajectories=64, **engine_kw)
    sampling = SamplingParams(max_new_tokens=max_new, stop_token_ids=STOPS, n=n, seed=0)
    return GroupStreamer(engine, sampling, pad_id=TOK.pad_token_id, chunk_tokens=chunk, batch_rows=64, order=order,
                         group_size_iter=G, max_staleness=s, load_newest=inbox.newest, load_version=inbox.exact,
                         version=lambda: inbox.loaded, lock=inbox.lock, newer_weights=newer_weights)


def groups(k: int) -> list[dict]:
    texts = ["hi", "hello there", "xyz", "abc abc", "q", "longer prompt here"]
    return [{"gid": g, "prompt": TOK(texts[g % len(texts)])["input_ids"], "seed": 100 + g} for g in range(k)]


def wait_finished(st: GroupStreamer, count: int, timeout_s: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = st.finished()
        if len(done) >= count:
            return done
        time.sleep(0.02)
    raise AssertionError(f"only {len(st.finished())} of {count} groups finished in {timeout_s} s")


def generate_all(st: GroupStreamer, k: int) -> list[dict]:
    """Start ``st``, hand it ``groups(k)``, wait for all k and pop them (stopped whatever happens)."""
    st.start()
    try:
        st.sync(groups(k))
        wait_finished(st, k)
        return st.pop(list(range(k)))
    finally:
        st.stop()


def teacher_forced(state: dict, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log p(token | prompt, tokens before) under ``state``: what the trainer computes."""
    model = build_tiny_model(len(TOK), hidden_size=32, layers=2, seed=0).eval()
    model.load_state_dict(state)
    ids = torch.tensor([prompt + tokens])
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=position_ids_from_mask(mask)).logits
    p = len(prompt)
    return log_probs_from_logits(logits[:, p - 1 : -1], torch.tensor([tokens]), temperature=1.0)[0]


def test_groups_generated_in_chunks_carry_the_log_probs_of_one_uninterrupted_response():
    inbox = Inbox(build_tiny_model(len(TOK), hidden_size=32, layers=2, seed=0).eval())
    st = streamer("completion", inbox)
    recs = generate_all(st, 4)
    assert st.stats["chunks"] > 12  # 4 groups × 3 rows, most needed more than one chunk of 4 tokens
    several_chunks = 0
    for rec, g in zip(recs, groups(4), strict=True):
        for tokens, lps, vers, finish in zip(rec["tokens"], rec["log_probs"], rec["versions"], rec["finish"],
                                             strict=True):
            assert 1 <= len(tokens) <= 12 and len(lps) == len(tokens) == len(vers)
            assert set(vers) == {0}
            assert finish == ("stop" if tokens[-1] in STOPS else "length")
            assert not any(t in STOPS for t in tokens[:-1])
            if finish == "length":
                assert len(tokens) == 12
            several_chunks += len(tokens) > 4
            ref = teacher_forced(W0, g["prompt"], tokens)
            assert torch.allclose(torch.tensor(lps), ref, atol=1e-4), (lps, ref)
    assert several_chunks > 0


def test_new_weights_land_between_chunks_and_each_token_keeps_its_version_and_log_prob():
    """Weights v1 are published while the groups are half done: unfinished rows continue under
    v1 with their prefix; tokens sampled before carry v0 and v0's log-probs, after v1's."""
    inbox = Inbox(build_tiny_model(len(TOK), hidden_size=32, layers=2, seed=0).eval())
    st = streamer("completion", inbox, chunk=3, max_new=12)
    real_chunk = st._chunk
    calls = []

    def chunk_then_publish(gs, version, seed):
        real_chunk(gs, version, seed)
        calls.append(version)
        if len(calls) == 1:
            inbox.publish(1, W1)  # after the first chunk: the next one loads v1

    st._chunk = chunk_then_publish
    recs = generate_all(st, 3)
    assert calls[0] == 0 and set(calls[1:]) == {1}
    assert st.stats["weight_loads"] == 1 and st.stats["interrupted_rows"] > 0
    mixed = 0
    for rec, g in zip(recs, groups(3), strict=True):
        for tokens, lps, vers in zip(rec["tokens"], rec["log_probs"], rec["versions"], strict=True):
            k = vers.count(0)
            assert vers == [0] * k + [1] * (len(vers) - k) and 1 <= k <= 3
            under0, under1 = teacher_forced(W0, g["prompt"], tokens), teacher_forced(W1, g["prompt"], tokens)
            got = torch.tensor(lps)
            assert torch.allclose(got[:k], under0[:k], atol=1e-4)
            assert torch.allclose(got[k:], under1[k:], atol=1e-4)
            if len(vers) > k:
                mixed += 1
                assert not torch.allclose(got[k:], under0[k:], atol=1e-3)  # v1 really is another policy
    assert mixed > 0


def _run_submission(publish_delays: dict[int, float]) -> list[dict]:
    """Submission order, G=2 groups per iteration, s=1: cohort 1 (gids 0, 1) at v0, cohort 2 (gids
    2, 3) starts at v0 and continues at v1, cohort 3 (4, 5) at v1 then v2. Versions are published
    after ``publish_delays`` seconds, cohorts submitted as a trainer would (cohort j+1 with take j)."""
    inbox = Inbox(build_tiny_model(len(TOK), hidden_size=32, layers=2, seed=0).eval())
    st = streamer("submission", inbox, chunk=3, max_new=9, G=2, s=1)
    gs = groups(6)
    st.start()
    out = []
    try:
        st.sync(gs[:4])  # take(1) tops up to (s+1)·G groups
        done = wait_finished(st, 2)
        assert {d["gid"] for d in done} >= {0, 1}
        out += st.pop([0, 1])
        time.sleep(publish_delays[1])
        inbox.publish(1, W1)  # update 1
        st.kick()
        st.sync(gs[2:6])  # take(2)
        deadline = time.monotonic() + 60
        while not {2, 3} <= {d["gid"] for d in st.finished()}:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        out += st.pop([2, 3])
        time.sleep(publish_delays[2])
        inbox.publish(2, W2)  # update 2
        st.kick()
        deadline = time.monotonic() + 60
        while not {4, 5} <= {d["gid"] for d in st.finished()}:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        out += st.pop([4, 5])
    finally:
        st.stop()
    return out


def test_submission_order_gives_the_same_groups_whatever_the_timing():
    fast = _run_submission({1: 0.0, 2: 0.0})
    slow = _run_submission({1: 0.5, 2: 0.5})
    for a, b in zip(fast, slow, strict=True):
        assert a["gid"] == b["gid"] and a["tokens"] == b["tokens"] and a["versions"] == b["versions"]
        assert torch.allclose(torch.tensor(sum(a["log_probs"], [])), torch.tensor(sum(b["log_probs"], [])), atol=1e-6)
    by_gid = {r["gid"]: r for r in fast}
    first_versions = {g: {v[0] for v in by_gid[g]["versions"]} for g in by_gid}
    assert first_versions[0] == first_versions[1] == {0}
    assert first_versions[2] == {0} and first_versions[4] == {1}  # V(j, 0) = j − 1 − s
    assert all(max(v) <= 1 for v in by_gid[2]["versions"])  # cohort 2 ends by v1 (j − 1)
    assert any(len(set(v)) > 1 for g in (2, 3, 4, 5) for v in by_gid[g]["versions"])  # partial rollouts happened


def test_sync_forgets_groups_not_wanted_and_starts_new_ones():
    inbox = Inbox(build_tiny_model(len(TOK), hidden_size=32, layers=2, seed=0).eval())
    st = streamer("completion", inbox)
    assert st.sync(groups(3)) == {"added": 3, "dropped": 0, "held": 3}
    assert st.sync(groups(5)[1:]) == {"added": 2, "dropped": 1, "held": 4}
    with pytest.raises(KeyError, match="not finished"):
        st.pop([1])
    with pytest.raises(ValueError, match="partial_chunk_tokens"):
        streamer("completion", inbox, chunk=0)


def test_a_failing_engine_stops_the_streamer_and_the_next_call_says_why():
    inbox = Inbox(build_tiny_model(len(TOK), hidden_size=32, layers=2, seed=0).eval())
    st = streamer("completion", inbox)

    def boom(*a, **k):
        raise RuntimeError("engine fell over")

    st.engine = copy.copy(st.engine)
    st.engine.generate = boom
    st.start()
    st.sync(groups(1))
    deadline = time.monotonic() + 10
    while st.running and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(Exception, match="engine fell over"):
        st.finished()
    st.engine = HFRolloutEngine(inbox.model, TOK, generation_batch_trajectories=64)  # fixed: a retry goes on
    st.start()
    try:
        st.sync(groups(1))
        assert [d["gid"] for d in wait_finished(st, 1)] == [0]
    finally:
        st.stop()


@pytest.mark.parametrize("engine_kw", [{}, {"drop_finished_rows": False}], ids=["fused", "transformers-generate"])
def test_an_interruptible_engine_decodes_each_response_on_one_kv_cache_while_the_weights_stay(engine_kw):
    """Completion order on the hf engine (``partial_rollout_interrupt``): with no newer weights, a
    group's rows come from one engine call, nothing is prefilled but the prompt, and the tokens and
    log-probs are those of one uninterrupted response."""
    inbox = Inbox(build_tiny_model(len(TOK), hidden_size=32, layers=2, seed=0).eval())
    asked = []

    def newer():
        asked.append(1)
        return max(inbox.published) > inbox.loaded

    st = streamer("completion", inbox, chunk=2, max_new=12, newer_weights=newer, **engine_kw)
    assert st.elastic
    recs = generate_all(st, 4)
    prompts = sum(len(g["prompt"]) for g in groups(4))
    assert st.stats["prefill_tokens"] == prompts  # each prompt once, no prefix re-prefilled
    assert st.stats["calls"] == 1 and st.stats["chunks"] == 12  # 4 groups × 3 rows in one call
    assert asked  # it did look for newer weights at the chunk boundaries
    longest = 0
    for rec, g in zip(recs, groups(4), strict=True):
        for tokens, lps, vers, finish in zip(rec["tokens"], rec["log_probs"], rec["versions"], rec["finish"],
                                             strict=True):
            assert set(vers) == {0} and finish == ("stop" if tokens[-1] in STOPS else "length")
            assert finish == "stop" or len(tokens) == 12
            longest = max(longest, len(tokens))
            assert torch.allclose(torch.tensor(lps), teacher_forced(W0, g["prompt"], tokens), atol=1e-4)
    assert longest > 2  # responses ran past the first chunk boundary in that one call


def test_an_interruptible_engine_stops_at_the_chunk_boundary_where_newer_weights_arrived():
    """v1 is published while the first call decodes (at its first chunk boundary): the call ends
    there, unfinished rows continue under v1 as a prefix, each token keeps its version and log-prob;
    a row never passes max_new_tokens though the continuing call runs to the largest room."""
    inbox = Inbox(build_tiny_model(len(TOK), hidden_size=32, layers=2, seed=0).eval())
    boundaries = []

    def newer():
        boundaries.append(inbox.loaded)
        if 1 not in inbox.published:
            inbox.publish(1, W1)  # arrives during the first call
        return max(inbox.published) > inbox.loaded

    st = streamer("completion", inbox, chunk=3, max_new=12, newer_weights=newer)
    recs = generate_all(st, 3)
    assert inbox.loads == [1] and st.stats["weight_loads"] == 1 and st.stats["interrupted_rows"] > 0
    assert st.stats["calls"] == 2  # the interrupted call, then one call continuing every unfinished row
    mixed = 0
    for rec, g in zip(recs, groups(3), strict=True):
        for tokens, lps, vers in zip(rec["tokens"], rec["log_probs"], rec["versions"], strict=True):
            k = vers.count(0)
            assert vers == [0] * k + [1] * (len(vers) - k) and 1 <= k <= 3 and len(tokens) <= 12
            got = torch.tensor(lps)
            assert torch.allclose(got[:k], teacher_forced(W0, g["prompt"], tokens)[:k], atol=1e-4)
            assert torch.allclose(got[k:], teacher_forced(W1, g["prompt"], tokens)[k:], atol=1e-4)
            if len(vers) > k:
                mixed += 1
                assert k == 3  # cut exactly at the first chunk boundary
    assert mixed > 0


@pytest.mark.parametrize("engine_kw", [{}, {"drop_finished_rows": False}], ids=["fused", "transformers-generate"])
def test_hf_generate_interrupted_keeps_the_prefix_of_the_uninterrupted_response(engine_kw):
    model = build_tiny_model(len(TOK), hidden_size=32, layers=2, seed=0).eval()
    engine = HFRolloutEngine(model, TOK, generation_batch_trajectories=64, **engine_kw)
    enc = TOK(["hello there", "q"], padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"].bool()
    sampling = SamplingParams(max_new_tokens=10, stop_token_ids=(), n=2, seed=3)
    whole = engine.generate(ids, mask, sampling)
    seen = []
    cut = engine.generate(ids, mask, sampling, interrupt=lambda k: seen.append(k) or k == 4)
    assert seen[:4] == [1, 2, 3, 4] and whole.response_ids.shape[1] == 10
    assert cut.response_ids.shape[1] == 4 and bool(cut.response_mask.all())
    assert torch.equal(cut.response_ids, whole.response_ids[:, :4])
    assert torch.allclose(cut.rollout_log_probs, whole.rollout_log_probs[:, :4], atol=1e-5)
