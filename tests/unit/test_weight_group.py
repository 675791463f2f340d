"""workers/weight_group.py: the weight-sync group (Gloo on CPU here) delivers the policy's tensors
exactly, by layout, to every rollout rank; two members in two threads of this process."""

from __future__ import annotations

import socket
import threading

import torch

from workers.weight_group import WeightGroup, empty_like_layout, layout_of


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_broadcast_delivers_every_tensor_exactly_to_every_rank():
    gen = torch.Generator().manual_seed(0)
    state = {"embed.weight": torch.randn(7, 5, generator=gen), "norm.weight": torch.rand(5, generator=gen),
             "step": torch.tensor([3], dtype=torch.int64), "half": torch.randn(4, generator=gen).to(torch.bfloat16)}
    layout = layout_of(state)
    assert layout[0] == ("embed.weight", [7, 5], "float32") and layout[3][2] == "bfloat16"
    port, world = _free_port(), 3
    received: dict[int, dict[str, torch.Tensor]] = {}
    errors: list[BaseException] = []

    def member(rank: int) -> None:
        try:
            group = WeightGroup("127.0.0.1", port, rank, world, torch.device("cpu"))
            tensors = state if rank == 0 else empty_like_layout(layout, torch.device("cpu"))
            group.broadcast(list(tensors.values()))
            received[rank] = tensors
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for rank in (1, 2):
        assert received[rank].keys() == state.keys()
        for k in state:
            assert received[rank][k].dtype == state[k].dtype and torch.equal(received[rank][k], state[k]), (rank, k)
