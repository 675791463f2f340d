"""workers/distributed.py rendezvous (issue 15 item 5): ranks of a pool on one node meet through a
file store and listen on 127.0.0.1 only; ranks on several nodes meet at rank 0's TCPStore."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from workers import distributed as D

ROOT = Path(__file__).resolve().parents[2]

RANK = r"""
import os, sys, psutil, torch, torch.distributed as dist
from workers import distributed as D
rank, port = int(sys.argv[1]), int(sys.argv[2])
D.init_process_group(rank, 2, master_addr="127.0.0.1", master_port=port, timeout_s=60)
t = torch.ones(1) * (rank + 1)
dist.all_reduce(t)
mine = [c.laddr.ip for c in psutil.net_connections("inet") if c.pid == os.getpid() and c.status == "LISTEN"]
print("SUM", float(t), "LISTEN", sorted(set(mine)), flush=True)
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush(); os._exit(0)  # no static destruction: see tests/unit/_dist_case.end_rank
"""


def test_a_loopback_group_meets_through_a_file_store():
    host, port = D.rendezvous_address("127.0.0.1")
    assert host == "127.0.0.1"
    assert D.rendezvous_url(host, port).startswith("file://") and str(port) in D.rendezvous_url(host, port)
    assert D.rendezvous_url("localhost", port).startswith("file://")
    assert D.rendezvous_url("10.1.2.3", port) == f"tcp://10.1.2.3:{port}"


def test_a_stale_store_file_of_the_port_is_removed_before_the_ranks_open_it(monkeypatch):
    monkeypatch.setattr(D, "find_free_port", lambda host="127.0.0.1": 34567)
    stale = D.rendezvous_url("127.0.0.1", 34567).removeprefix("file://")
    Path(stale).write_bytes(b"left by a group that died")
    D.rendezvous_address("127.0.0.1")
    assert not os.path.exists(stale)


def test_two_local_ranks_all_reduce_and_listen_on_loopback_only():
    _, port = D.rendezvous_address("127.0.0.1")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(port)], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (0, 1)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        outs.append(out)
    for out in outs:
        line = next(x for x in out.splitlines() if x.startswith("SUM"))
        assert line.startswith("SUM 3.0 ")  # 1 + 2
        listening = ast.literal_eval(line.split("LISTEN", 1)[1].strip())
        # torch's TCPStore listened on '::' (every interface); gloo's own pairs stay on loopback
        assert listening and all(ip.startswith("127.") or ip == "::1" for ip in listening), listening
