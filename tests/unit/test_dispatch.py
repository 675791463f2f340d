import torch

from hybridflow.batch import Batch
from workers.dispatch import dispatch, get_dispatch, protocol_of, register_dispatch


def _batch():
    # 3 groups with interleaved rows and different lengths
    uid = ["a", "b", "a", "c", "b", "c"]
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]).bool()
    return Batch.from_dict({"response_mask": mask, "x": torch.arange(6)}, {"uid": uid})


def test_dp_scatter_round_trip_restores_order():
    b = _batch()
    proto = get_dispatch("dp_scatter")
    calls, info = proto.split((b,), {}, 2)
    outs = []
    for (args, _kw) in calls:
        part = args[0]
        assert len(set(part["uid"])) >= 1
        part = part.union(Batch.from_dict({"y": part["x"] * 10}))
        outs.append(part)
    joined = proto.join(outs, info)
    assert joined["uid"] == b["uid"]
    assert torch.equal(joined["y"], b["x"] * 10)


def test_groups_never_split_across_ranks():
    calls, _ = get_dispatch("dp_scatter").split((_batch(),), {}, 2)
    uids = [set(c[0][0]["uid"]) for c in calls]
    assert not (uids[0] & uids[1])


def test_rank_zero_and_declaration_and_user_protocol():
    calls, _ = get_dispatch("rank_zero").split((1,), {}, 3)
    assert calls[1] is None and calls[0] == ((1,), {})

    @dispatch("rank_zero")
    def f():
        pass

    assert protocol_of(f) == "rank_zero"
    register_dispatch("first_two_test", lambda a, k, w: ([(a, k)] * 2 + [None] * (w - 2), None), lambda r, i: r)
    assert len(get_dispatch("first_two_test").split((), {}, 4)[0]) == 4
    try:
        get_dispatch("nope")
    except KeyError as e:
        assert "dp_scatter" in str(e)
    else:
        raise AssertionError


def test_call_ranks_returns_rank_zeros_none(monkeypatch):
    """A rank_zero method whose answer is None (e.g. no weight-sync group yet) returns None, and
    broadcast keeps every rank's answer — the ranks not called are dropped only for dp protocols."""
    from types import SimpleNamespace

    import workers.handles as H

    class Actor:
        def __init__(self, answer):
            self.call_logged = SimpleNamespace(remote=lambda role, method, *a, **k: (answer, [f"said {answer}"]))

    monkeypatch.setattr(H.ray, "get", lambda ref, timeout=None: ref)
    pool = SimpleNamespace(actors=[Actor(None), Actor(7)], world_size=2, name="p")
    assert H.call_ranks(pool, "policy", "m", get_dispatch("rank_zero"), (), {}) is None
    assert H.call_ranks(pool, "policy", "m", get_dispatch("broadcast"), (), {}) == [None, 7]
