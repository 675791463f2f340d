"""Tools and environments the multi-turn tests load by spec (tests.unit.agent_fixtures:...)."""

from __future__ import annotations

import os
import time

from hybridflow.agents import StepResult


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def flood(x: int) -> str:
    """Prints and returns 10 MB of text (multi-byte characters included).

    Args:
        x: Ignored.
    """
    text = "head-é" + "ab€" * (10 * (1 << 20) // 5) + "-tail"
    print(text)
    return text


def boom(x: int) -> str:
    """Always raises.

    Args:
        x: Ignored.
    """
    raise RuntimeError("boom")


def hang(x: int) -> str:
    """Never returns.

    Args:
        x: Ignored.
    """
    time.sleep(3600)
    return ""


def die(x: int) -> str:
    """Kills its process.

    Args:
        x: Ignored.
    """
    os._exit(3)


def no_doc(x: int) -> int:
    return x


class GuessEnv:
    """Guess a number: reward 1 and done on the right guess, else 'higher' / 'lower' as observation."""

    def __init__(self, target: int = 7) -> None:
        self.target = target
        self.guesses = 0

    def reset(self, row):
        return None

    def step(self, text: str):
        self.guesses += 1
        digits = "".join(c for c in text if c.isdigit())
        if digits and int(digits) == self.target:
            return "correct", 1.0, True
        hint = "higher" if not digits or int(digits) < self.target else "lower"
        return StepResult(hint, -0.1, False, {"guesses": self.guesses})


class AsyncEchoEnv:
    """Async reset (starts from its own messages) and step; never done."""

    async def reset(self, row):
        return [{"role": "user", "content": "echo"}]

    async def step(self, text: str):
        return f"echo:{text[:4]}", 0.5, False


class BrokenEnv:
    def reset(self, row):
        return None

    def step(self, text: str):
        raise ValueError("the environment broke")


class PidLogEnv:
    """Appends "<pid> <parent pid>" of the process running each step to the file ``log`` (the row's
    env_kwargs), then answers like a fixed environment: "noted", reward 0.5, never done."""

    def __init__(self, log: str) -> None:
        self.log = log

    def reset(self, row):
        return None

    def step(self, text: str):
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()} {os.getppid()}\n")
        return "noted", 0.5, False


class LiveCounterEnv:
    """A sticky environment (``picklable = False``): it holds one end of an open socket pair, which
    cannot be pickled, and counts its steps through it (each step sends a byte and reads it back).
    Observation "step <n> in <pid>"; reward n; done when the text contains "stop". ``close()`` appends
    "<tag> closed after <n>" to the file ``log`` (env_kwargs)."""

    picklable = False

    def __init__(self, log: str = "", tag: str = "") -> None:
        import socket

        self.log, self.tag, self.n = log, tag, 0
        self.a, self.b = socket.socketpair()

    def reset(self, row):
        return None

    def step(self, text: str):
        self.a.sendall(b"x")
        self.n += len(self.b.recv(1))
        return f"step {self.n} in {os.getpid()}", float(self.n), "stop" in text

    def close(self) -> None:
        self.a.close()
        self.b.close()
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{self.tag} closed after {self.n}\n")


class UndeclaredSocketEnv(LiveCounterEnv):
    """The same environment without the declaration: its instance cannot travel as a pickle."""

    picklable = True


class ExitEnv:
    """Kills its worker process at the first step (os._exit)."""

    def reset(self, row):
        return None

    def step(self, text: str):
        os._exit(3)


def _gym_env_base():
    import gymnasium

    return gymnasium.Env


class StairsGym(_gym_env_base()):
    """A Gymnasium environment (Discrete(3, start=1) actions): climb to step ``top`` by adding the
    action each turn; reward 1 on reaching it exactly, terminated; overshooting ends it (truncated,
    reward -1). The observation says where you stand."""

    def __init__(self, top: int = 5) -> None:
        from gymnasium import spaces

        self.top = top
        self.action_space = spaces.Discrete(3, start=1)
        self.observation_space = spaces.Text(64)
        self.pos = 0

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.pos = int(self.np_random.integers(0, 2))
        return f"you stand on step {self.pos} of {self.top}", {}

    def step(self, action):
        self.pos += int(action)
        if self.pos == self.top:
            return "top reached", 1.0, True, False, {}
        if self.pos > self.top:
            return "overshot", -1.0, False, True, {}
        return f"you stand on step {self.pos} of {self.top}", 0.0, False, False, {}
