"""A real multi-node Ray cluster on this machine, for tests: ``ray start --head`` and ``ray start
--address=...`` processes, each its own raylet (a separate node to Ray's scheduler), on loopback
addresses (Ray turns 127.0.0.1 into the machine's outward IP, so the head uses 127.0.0.2 and the
other nodes 127.0.0.3, ...), with every port chosen free, a temp dir of our own and each node's
working directory of its own (Ray workers run there, not in the driver's directory).

Stopped by what we started: each ``ray start --block`` is its own process group (SIGTERM, then
SIGKILL), and Ray workers — which put themselves in their own process groups — are found by
their working directory under our folder. Never a machine-wide ``ray stop``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from workers.distributed import find_free_port

RAY = str(Path(sys.executable).with_name("ray"))
REPO = Path(__file__).resolve().parents[2]


def cluster_env() -> dict[str, str]:
    """Environment for every process of the cluster and its drivers."""
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(REPO),
            "TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "0",
            # as flows.runtime.ensure_ray sets for a local Ray: keep idle task workers warm (each new
            # one pays for the Prefect + torch imports) and at normal priority
            "RAY_num_workers_soft_limit": "8", "RAY_worker_niceness": "0", "RAY_TQDM_PATCH_PRINT": "0"}


@dataclass
class Node:
    name: str
    ip: str
    cwd: Path
    proc: subprocess.Popen
    log: Path

    def raylet_pid(self) -> int:
        """PID of this node's raylet (a child in the ``ray start`` process group)."""
        for pid in _pids():
            if _comm(pid) == "raylet" and _pgid(pid) == self.proc.pid:
                return pid
        raise RuntimeError(f"node {self.name}: no raylet in process group {self.proc.pid}")


@dataclass
class LocalRayCluster:
    root: Path
    port: int = field(default_factory=find_free_port)
    nodes: list[Node] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.2:{self.port}"

    def _start(self, name: str, ip: str, num_cpus: int, head: bool) -> Node:
        cwd = self.root / name
        cwd.mkdir(parents=True, exist_ok=True)
        log = self.root / f"{name}.log"
        ports = {f"--{k}": str(find_free_port()) for k in (
            "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port")}
        args = [RAY, "start", "--block", f"--node-ip-address={ip}", f"--num-cpus={num_cpus}", "--num-gpus=0",
                f"--resources={json.dumps({name: 1})}", "--disable-usage-stats",
                *[f"{k}={v}" for k, v in ports.items()]]
        if head:
            args += ["--head", f"--port={self.port}", f"--temp-dir={self.root / 'ray'}", "--include-dashboard=false",
                     f"--ray-client-server-port={find_free_port()}", f"--dashboard-port={find_free_port()}"]
        else:
            args += [f"--address={self.address}"]
        proc = subprocess.Popen(args, cwd=cwd, env=cluster_env(), stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                                start_new_session=True)
        node = Node(name, ip, cwd, proc, log)
        self.nodes.append(node)
        deadline = time.monotonic() + 180
        while "Ray runtime started" not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray node {name} did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)
        return node

    def start_head(self, num_cpus: int) -> Node:
        return self._start("head", "127.0.0.2", num_cpus, head=True)

    def add_node(self, name: str, num_cpus: int) -> Node:
        return self._start(name, f"127.0.0.{len(self.nodes) + 2}", num_cpus, head=False)

    def node_ids(self) -> dict[str, str]:
        """{node ip: Ray node id} of the alive nodes (asked by a short-lived driver of its own)."""
        code = (f"import json, ray; ray.init(address={self.address!r}, include_dashboard=False, log_to_driver=False); "
                "print(json.dumps({n['NodeManagerAddress']: n['NodeID'] for n in ray.nodes() if n['Alive']}))")
        out = subprocess.run([sys.executable, "-c", code], env=cluster_env(), capture_output=True, text=True,
                             timeout=120, cwd=self.root)
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-2000:])
        return json.loads(out.stdout.strip().splitlines()[-1])

    def kill_raylet(self, node: Node) -> int:
        """SIGKILL one node's raylet by PID (the node fails; the rest of its group is left to us)."""
        pid = node.raylet_pid()
        os.kill(pid, signal.SIGKILL)
        return pid

    def stop_node(self, node: Node) -> None:
        _stop_group(node.proc)
        for pid in _pids():  # Ray workers of this node (own process groups), by working directory
            if _cwd(pid).startswith(str(node.cwd)):
                _kill(pid)

    def stop(self) -> None:
        for node in reversed(self.nodes):
            self.stop_node(node)
        for pid in _pids():
            if _cwd(pid).startswith(str(self.root)):
                _kill(pid)


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:
            try:  # the group may outlive its leader
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        break


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _comm(pid: int) -> str:
    return _read(f"/proc/{pid}/comm").strip()


def _pgid(pid: int) -> int:
    stat = _read(f"/proc/{pid}/stat")
    return int(stat.rsplit(")", 1)[1].split()[2]) if stat else -1


def _cwd(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return ""


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
