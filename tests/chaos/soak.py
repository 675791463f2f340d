"""The chaos soak (issue 40): one seeded training run of the tiny model hit by faults at seeded
random points, each fault that ends the driver followed by ``hybridflow train --resume``, then
compared with an uninterrupted run of the same config and seed: final weights bit for bit, every
non-timing metric, the update ledger (each update exactly once, on the same batch).

The machinery is the reliability tests': ``tests/train_process.py`` starts, waits for and kills the
CLI; ``tests/integration/hold_plugins.py`` holds a pool actor's call (after its work, before its
result returns) until it is SIGKILLed (``ActorKiller``); ``tests/fixtures/compare_runs.py`` compares
two run folders. Fault kinds (:data:`KINDS`):

=================  =====================================================================  ==========
kind               what happens                                                           driver
=================  =====================================================================  ==========
driver_sigkill     SIGKILL of the CLI's process group once a chosen node of iteration k   resumed
                   started (execution_log.jsonl)
driver_sigterm     SIGTERM of the CLI's pid there; it must exit 143 within 60 s            resumed
actor_kill         SIGKILL of a pool actor inside its call of iteration k (rollout or     goes on
                   update; the rollout pool's generation in async runs)
reward_crash       SIGKILL of the run's reward worker process after iteration k's reward  goes on
                   node (between calls, as an OOM kill would)
corrupt_checkpoint SIGKILL of the CLI, then the latest checkpoint's weights file cut in   resumed
                   half: the resume falls back to the newest intact checkpoint
enospc             the run folder is a small tmpfs; at iteration k a filler file takes    resumed
                   its free space: the run must stop (not hang), the filler is removed
=================  =====================================================================  ==========

A tool hang has a run of its own (``tests/chaos/test_tool_hang.py``, ``make test-chaos``): the tiny
random model never writes a tool call, so the hang is a multi-turn environment step (the same
crash-proof pool and ``tool_timeout_s`` as a tool call) on a seeded row, met by both runs.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tests.integration.conftest import tiny_overrides
from tests.integration.test_reliability_runs import VARIED_REWARD, ActorKiller, executions, read_jsonl
from tests.train_process import kill_group, start_train

KINDS = ("driver_sigkill", "driver_sigterm", "actor_kill", "reward_crash", "corrupt_checkpoint", "enospc")
ENDS_DRIVER = {"driver_sigkill", "driver_sigterm", "corrupt_checkpoint", "enospc"}
NODES = ("rollout", "reward", "advantage", "update_policy")  # a driver fault lands after one started
DRIVER_NODE_KINDS = {"driver_sigkill", "driver_sigterm", "enospc"}
SAVE_EVERY = 2
ROLLOUT_POOL = {"placement.pools.gen.workers": "1", "placement.pools.gen.cpus_per_worker": "0.5",
                "placement.pools.gen.roles": "[rollout]"}
TMPFS_MB = 64


@dataclass
class Fault:
    kind: str
    iteration: int
    node: str = "rollout"  # driver faults: after this node of the iteration started
    detail: str = ""
    survived: bool = False


@dataclass
class Soak:
    """One mode's soak: its config, plan and what happened."""

    mode: str  # "sync" (trainer.max_staleness 0) or "async" (1, a rollout pool apart)
    iterations: int
    seed: int
    root: Path
    faults: list[Fault] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    def say(self, line: str) -> None:
        line = f"[{self.mode}] {line}"
        self.log.append(line)
        print(line, flush=True)


def plan(seed: int, n_faults: int, iterations: int, mode: str, kinds: tuple[str, ...] = KINDS) -> list[Fault]:
    """``n_faults`` faults, every kind of ``kinds`` once before any repeats, at distinct seeded
    iterations after the second checkpoint, one per equal stretch of the run (a corrupt latest checkpoint then has an intact one
    before it to fall back to), in order; a driver fault lands after a seeded node started."""
    rng = random.Random(f"{seed}-{mode}")
    chosen = list(kinds) * (n_faults // len(kinds)) + rng.sample(kinds, n_faults % len(kinds))
    rng.shuffle(chosen)
    slots = list(range(2 * SAVE_EVERY + 1, iterations))
    assert n_faults <= len(slots), f"{n_faults} faults need more than {iterations} iterations"
    faults = []
    bins = [slots[len(slots) * i // n_faults : len(slots) * (i + 1) // n_faults] for i in range(n_faults)]
    for kind, it in zip(chosen, [rng.choice(b) for b in bins], strict=True):  # spread over the run
        nodes = NODES + (("checkpoint",) if it % SAVE_EVERY == 0 else ())
        faults.append(Fault(kind, it, rng.choice(nodes) if kind in DRIVER_NODE_KINDS else "rollout"))
    return faults


def overrides(soak: Soak, data: Path, runs: Path, run_id: str, ray_address: str) -> list[str]:
    extra = {
        "trainer.run_id": run_id,
        "trainer.seed": str(soak.seed),
        "trainer.total_iterations": str(soak.iterations),
        "trainer.total_epochs": "100",
        "trainer.save_every": str(SAVE_EVERY),
        "rollout.max_response_tokens": "8",
        "reward.function": f"{data / 'varied_reward.py'}:compute_score",
        "reward.timeout_s": "30",
        "actor.old_log_probs": "recompute",
        "trainer.plugins": "[tests.integration.hold_plugins]",
        "placement.ray_address": ray_address,
        "tracking.mlflow_uri": f"sqlite:///{soak.root}/mlflow.db",  # outside the (maybe full) run folder
    }
    if soak.mode == "async":
        extra |= {"trainer.max_staleness": "1", **ROLLOUT_POOL}
    return tiny_overrides(str(runs), str(data / "train.parquet"), str(data / "val.parquet"), **extra)


def write_data(d: Path) -> Path:
    from hybridflow.data import write_rows
    from hybridflow.data.tasks import make_arith

    d.mkdir(parents=True, exist_ok=True)
    write_rows(make_arith(10, difficulty=0, seed=41), str(d / "train.parquet"))  # 20 iterations = 4 epochs
    write_rows(make_arith(2, difficulty=0, seed=42), str(d / "val.parquet"))
    (d / "varied_reward.py").write_text(VARIED_REWARD)
    return d


# ---- the run folder on a small tmpfs (ENOSPC for real) ------------------------------------------------
def mount_tmpfs(path: Path, mb: int = TMPFS_MB) -> bool:
    """A ``mb`` MiB tmpfs on ``path`` (root with CAP_SYS_ADMIN); False where mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m", "hybridflow-chaos", str(path)],
                       capture_output=True, text=True)
    return r.returncode == 0


def umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(path: Path) -> Path:
    """A file that takes every free byte of ``path``'s file system."""
    filler = path / "chaos-filler.bin"
    with open(filler, "wb", buffering=0) as f:  # unbuffered: the close must not flush into a full disk
        chunk = b"\0" * (1 << 20)
        try:
            while True:
                f.write(chunk)
        except OSError:
            pass
        try:  # the last partial MiB
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    return filler


# ---- the run ---------------------------------------------------------------------------------------
def _wait_node(run_dir: Path, entry: tuple[int, str], proc: subprocess.Popen, log: Path, timeout_s: float = 600) -> bool:
    """True once ``entry`` (iteration, node) started; False if the CLI ended first."""
    deadline = time.monotonic() + timeout_s
    while entry not in executions(run_dir):
        if proc.poll() is not None:
            return False
        assert time.monotonic() < deadline, f"{entry} never ran:\n{log.read_text(errors='replace')[-3000:]}"
        time.sleep(0.05)
    return True


def _reward_workers() -> list[psutil.Process]:
    """The reward worker processes among this process's descendants (the test's Ray cluster)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "hybridflow.rewards._worker" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out


def _corrupt_latest(run_dir: Path) -> str:
    from workers.checkpoint import load_latest

    step = Path(load_latest(run_dir / "checkpoints"))
    target = sorted((step / "policy").glob("*.safetensors"))[0]
    size = target.stat().st_size
    with open(target, "r+b") as f:
        f.truncate(size // 2)
    return f"{step.name}/policy/{target.name} cut {size} -> {size // 2} bytes"


def run_chaos(soak: Soak, args: list[str], run_dir: Path, runs: Path, tmpfs: bool) -> None:
    """The chaos run: start, inject each planned fault, resume after the ones that end the driver."""
    logs = soak.root / "logs"
    logs.mkdir(exist_ok=True)
    n = 0

    def start(cli_args: list[str]) -> tuple[subprocess.Popen, Path]:
        nonlocal n
        n += 1
        log = logs / f"driver-{n}.log"
        return start_train(cli_args, log=log), log

    proc, log = start(args)
    going_on: list[Fault] = []  # faults the driver should have lived through; survived if it goes on

    def lived(ok: bool) -> None:
        for f in going_on:
            f.survived = ok
        going_on.clear()

    try:
        for fault in soak.faults:
            it = fault.iteration
            if fault.kind == "actor_kill":
                _actor_kill(soak, fault, run_dir)
                going_on.append(fault)
                continue
            if fault.kind == "reward_crash":
                assert _wait_node(run_dir, (it, "advantage"), proc, log), log.read_text(errors="replace")[-3000:]
                workers = _reward_workers()
                assert workers, "no reward worker process found"
                victim = workers[0]
                victim.kill()
                victim.wait(10)
                fault.detail = f"reward worker pid {victim.pid} SIGKILLed after iteration {it}'s reward"
                soak.say(f"fault {fault.kind} at iteration {it}: {fault.detail}")
                going_on.append(fault)
                continue
            # faults that end the driver
            assert _wait_node(run_dir, (it, fault.node), proc, log), log.read_text(errors="replace")[-3000:]
            lived(proc.poll() is None)
            if fault.kind == "driver_sigterm":
                time.sleep(0.3)  # inside the node
                proc.send_signal(signal.SIGTERM)
                try:
                    rc = proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    rc = None
                kill_group(proc)
                fault.detail = f"after {fault.node} started: rc {rc}, last line {_last_line(log)!r}"
                fault.survived = rc == 143
            elif fault.kind == "enospc":
                if not tmpfs:
                    fault.detail = "no tmpfs (mount not allowed here): skipped"
                    soak.say(f"fault enospc at iteration {it}: {fault.detail}")
                    continue
                filler = fill(runs)
                try:
                    rc = proc.wait(timeout=240)
                except subprocess.TimeoutExpired:
                    rc = None
                kill_group(proc)
                filler.unlink()
                fault.detail = f"disk filled after {fault.node} started: rc {rc}, last line {_last_line(log)[:200]!r}"
                # it stopped, neither hung nor finished on a full disk, and said so in one line (no traceback)
                fault.survived = rc == 1 and _last_line(log).startswith("error: ")
            else:  # driver_sigkill, corrupt_checkpoint
                kill_group(proc)
                fault.detail = f"SIGKILL after {fault.node} started"
                if fault.kind == "corrupt_checkpoint":
                    fault.detail += "; " + _corrupt_latest(run_dir)
                fault.survived = True  # the resume and the final comparison confirm it
            soak.say(f"fault {fault.kind} at iteration {it}: {fault.detail}")
            proc, log = start(["--resume", str(run_dir)])
            if fault.kind == "corrupt_checkpoint":
                deadline = time.monotonic() + 300
                while not (warn := [x for x in log.read_text(errors="replace").splitlines() if "damaged" in x]):
                    if proc.poll() is not None or time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
                soak.say(f"  the resume said: {warn[0][:240] if warn else 'NOTHING about the damage'}")
                fault.survived = bool(warn)
        rc = proc.wait(timeout=1800)
        lived(rc == 0)
        assert rc == 0, f"the last driver exited {rc}:\n{log.read_text(errors='replace')[-4000:]}"
    finally:
        kill_group(proc)


def _last_line(log: Path) -> str:
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    return lines[-1] if lines else ""


def _actor_kill(soak: Soak, fault: Fault, run_dir: Path) -> None:
    """SIGKILL a pool actor inside iteration ``fault.iteration``'s rollout or policy update."""
    it = fault.iteration
    rng = random.Random(f"{soak.seed}-{soak.mode}-{it}")
    if soak.mode == "async":  # iteration j generates with the weights after update j-2 on the rollout pool
        key = rng.choice([f"rollout_generate-v{it - 2}", f"update_policy-v{it - 1}"])
    else:
        key = rng.choice([f"generate_sequences-v{it - 1}", f"update_policy-v{it - 1}"])
    killer = ActorKiller(run_dir, [key])
    killer.start()
    killer.join(timeout=900)
    assert killer.error is None and killer.kills, f"actor kill {key}: {killer.error}"
    fault.detail = f"{key} held and its actor (pid {killer.kills[0]['pid']}) SIGKILLed"
    soak.say(f"fault actor_kill at iteration {it}: {fault.detail}")


# ---- the comparison ---------------------------------------------------------------------------------
def ledger(run_dir: Path) -> list[tuple]:
    """The policy update ledger: (version before, iteration, batch node, rows, batch checksum)."""
    return [(e["version_before"], e["iteration"], e["ref"]["node"], e["ref"]["rows"], e["ref"]["checksum"])
            for e in read_jsonl(run_dir / "updates_policy.jsonl")]


def table(soaks: list[Soak]) -> str:
    """Faults injected and survived by kind (and mode)."""
    rows = Counter()
    for s in soaks:
        for f in s.faults:
            if "skipped" in f.detail:
                continue
            rows[(f.kind, s.mode, "injected")] += 1
            rows[(f.kind, s.mode, "survived")] += f.survived
    modes = [s.mode for s in soaks]
    head = f"{'kind':<20}" + "".join(f"{m + ' injected':>16}{m + ' survived':>16}" for m in modes)
    lines = [head, "-" * len(head)]
    for kind in KINDS:
        lines.append(f"{kind:<20}" + "".join(f"{rows[(kind, m, 'injected')]:>16}{rows[(kind, m, 'survived')]:>16}"
                                              for m in modes))
    total = "".join(f"{sum(rows[(k, m, 'injected')] for k in KINDS):>16}{sum(rows[(k, m, 'survived')] for k in KINDS):>16}"
                    for m in modes)
    lines.append(f"{'total':<20}" + total)
    return "\n".join(lines)


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


__all__ = ["KINDS", "Soak", "Fault", "plan", "overrides", "write_data", "run_chaos", "ledger", "table",
           "mount_tmpfs", "umount", "env_int"]
