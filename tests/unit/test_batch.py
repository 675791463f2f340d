import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.batch import Batch, BatchError


def _batch(n_prompts=3, n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = Batch.from_dict(
        {"prompt_ids": torch.randint(0, 50, (n_prompts, 4), generator=g), "prompt_mask": torch.ones(n_prompts, 4, dtype=torch.bool)},
        {"uid": [f"p{i}" for i in range(n_prompts)], "ground_truth": [str(i) for i in range(n_prompts)]},
    )
    b = prompts.repeat_interleave(n)
    rlen = torch.randint(1, 6, (len(b),), generator=g)
    mask = torch.arange(6)[None, :] < rlen[:, None]
    b.set("response_mask", mask)
    b.set("old_log_probs", torch.randn(len(b), 6, generator=g))
    b.set("finish_reason", ["stop"] * len(b))
    return b


def test_round_trip_is_bit_exact(tmp_path):
    b = _batch()
    b.meta["weights_version"] = 3
    ref = b.save(str(tmp_path / "iter_000001" / "rollout"), run_id="r", iteration=1, node="rollout")
    back = ref.load()
    assert back.keys() == b.keys() and back.meta == b.meta
    for k in b.tensors.keys():
        assert back[k].dtype == b[k].dtype and torch.equal(back[k], b[k])
    assert back.non_tensors == b.non_tensors
    assert ref.rows == len(b) and ref.checksum == b.save(str(tmp_path / "again")).checksum


def test_round_trip_memory_fs():
    b = _batch()
    ref = b.save("memory://hf-test/rollout")
    assert torch.equal(ref.load()["response_mask"], b["response_mask"])


def test_checksum_mismatch_detected(tmp_path):
    b = _batch()
    ref = b.save(str(tmp_path / "x"))
    _batch(seed=1).save(str(tmp_path / "x"))
    try:
        ref.load()
    except BatchError as e:
        assert "checksum" in str(e)
    else:
        raise AssertionError("changed batch was not detected")


def test_repeat_interleave_keeps_uid_per_group():
    b = _batch(n_prompts=3, n=4)
    assert b["uid"] == ["p0"] * 4 + ["p1"] * 4 + ["p2"] * 4
    assert torch.equal(b["prompt_ids"][0], b["prompt_ids"][3])
    assert b["ground_truth"][4] == "1"


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(1, 4), st.integers(1, 4), st.integers(0, 1000))
def test_split_by_groups_never_splits_and_balances(n_prompts, n, k, seed):
    if n_prompts < k:
        return
    b = _batch(n_prompts, n, seed)
    parts = b.split_by_groups(k)
    assert sum(len(p) for p in parts) == len(b)
    seen = [u for p in parts for u in set(p["uid"])]
    assert len(seen) == len(set(seen)) == n_prompts  # each group in exactly one part
    group_counts = [len(set(p["uid"])) for p in parts]
    assert max(group_counts) - min(group_counts) <= 1
    # token balance: greedy LPT is within one group's weight of the lightest part
    tokens = b.token_counts()
    groups = b.groups()
    heaviest_group = max(sum(tokens[i] for i in g) for g in groups)
    loads = [sum(p.token_counts()) for p in parts]
    if len(set(group_counts)) == 1:
        assert max(loads) - min(loads) <= heaviest_group


def test_split_by_groups_too_few_groups():
    try:
        _batch(2, 2).split_by_groups(3)
    except BatchError as e:
        assert "2 groups" in str(e)
    else:
        raise AssertionError


def test_concat_and_union():
    b = _batch()
    parts = b.split_by_groups(2)
    back = Batch.concat(parts)
    assert sorted(back["uid"]) == sorted(b["uid"]) and len(back) == len(b)
    extra = Batch.from_dict({"advantages": torch.zeros(len(b), 6)})
    u = b.union(extra)
    assert "advantages" in u and "old_log_probs" in u


def test_wrong_dtype_rejected():
    try:
        Batch.from_dict({"response_mask": torch.ones(2, 3)})
    except BatchError as e:
        assert "response_mask" in str(e) and "bool" in str(e)
    else:
        raise AssertionError


def test_aliased_tensors_save(tmp_path):
    scores = torch.ones(2, 3)
    b = Batch.from_dict({"token_level_scores": scores, "token_level_rewards": scores})
    back = b.save(str(tmp_path / "a")).load()
    assert torch.equal(back["token_level_rewards"], scores)


def _padded(prompt_lens, response_lens, p_len=5, r_len=6):
    """Left-padded prompts and right-padded responses of the given lengths, with position_ids and a
    response-aligned float key; ids are 100 + column so slices can be read back."""
    n = len(prompt_lens)
    pm = torch.arange(p_len)[None, :] >= (p_len - torch.tensor(prompt_lens))[:, None]
    rm = torch.arange(r_len)[None, :] < torch.tensor(response_lens)[:, None]
    return Batch.from_dict({
        "prompt_ids": (100 + torch.arange(p_len)).repeat(n, 1), "prompt_mask": pm,
        "response_ids": (200 + torch.arange(r_len)).repeat(n, 1), "response_mask": rm,
        "position_ids": torch.arange(p_len + r_len).repeat(n, 1),
        "advantages": torch.arange(r_len, dtype=torch.float32).repeat(n, 1),
        "scores": torch.ones(n),  # 1-D: rides along
    }, {"uid": [f"u{i}" for i in range(n)]})


def test_trim_padding_drops_columns_that_are_padding_in_every_row():
    b = _padded(prompt_lens=[2, 3], response_lens=[1, 4])  # 2 all-pad prompt columns, 2 response columns
    t = b.trim_padding()
    assert t["prompt_ids"][0].tolist() == [102, 103, 104] and t["prompt_mask"].tolist() == [[False, True, True],
                                                                                          [True, True, True]]
    assert t["response_ids"][0].tolist() == [200, 201, 202, 203] and t["advantages"].shape == (2, 4)
    assert t["position_ids"][0].tolist() == [2, 3, 4, 5, 6, 7, 8]  # prompt cols 2-4, response cols 0-3
    assert t["response_mask"].sum() == b["response_mask"].sum() and t["prompt_mask"].sum() == b["prompt_mask"].sum()
    assert torch.equal(t["scores"], b["scores"]) and t["uid"] == b["uid"]


def test_trim_padding_leaves_what_it_cannot_trim_safely():
    full = _padded(prompt_lens=[5, 1], response_lens=[6, 2])
    assert full.trim_padding() is full  # nothing to trim
    unknown = _padded(prompt_lens=[2, 2], response_lens=[1, 1])
    unknown.set("my_response_weights", torch.ones(2, 6))  # 2-D, response width, alignment unknown
    assert unknown.trim_padding() is unknown
    empty = _padded(prompt_lens=[0, 0], response_lens=[0, 0]).trim_padding()  # keeps one column of each
    assert empty["prompt_ids"].shape == (2, 1) and empty["response_ids"].shape == (2, 1)
    assert empty["position_ids"].shape == (2, 2)
    assert _batch().trim_padding()["prompt_ids"].shape[1] == 4  # no all-pad prompt column


def test_shallow_copy_shares_values_not_containers():
    b = _batch()
    b.meta["weights_version"] = 2
    c = b.shallow_copy()
    c.set("advantages", torch.zeros(len(b), 6))
    c.set("finish_reason", ["length"] * len(b))
    c.meta["weights_version"] = 3
    assert "advantages" not in b and b["finish_reason"] == ["stop"] * len(b) and b.meta["weights_version"] == 2
    assert c["old_log_probs"] is b["old_log_probs"]  # the tensors themselves are not copied
    assert c["uid"] is b["uid"]
