"""Small verifiers environments for tests/unit/test_env_verifiers.py, written the way verifiers
environments are (a ``load_environment`` function returning a ``vf.Environment``), in a module of its own
so the environment workers of :class:`hybridflow.agents.remote.EnvRunner` import them by spec."""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

CLEANED: list[str] = []  # trajectory ids whose rollout ran its cleanup handlers (this process)


def _text(message) -> str:
    return message["content"] if isinstance(message, dict) else message.content


def load_sums(**kwargs) -> vf.Environment:
    """A SingleTurnEnv: two sums, a rubric of one reward function (1.0 when the answer is in the reply)."""
    data = Dataset.from_list([{"question": "What is 2+3?", "answer": "5"}, {"question": "What is 4+4?", "answer": "8"}])

    def correct(completion, answer, **_) -> float:
        return 1.0 if answer in _text(completion[-1]) else 0.0

    return vf.SingleTurnEnv(dataset=data, system_prompt="Answer with a number.", rubric=vf.Rubric(funcs=[correct]))


class GuessEnv(vf.MultiTurnEnv):
    """Guess the dataset row's number: 'higher' / 'lower' until right, then a final 'correct'."""

    async def env_response(self, messages, state, **kwargs):
        guess, target = _text(messages[-1]).strip(), state["answer"]
        if guess == target:
            state["won"] = True
            state["final_env_response"] = [vf.UserMessage(content="correct")]
            return state["final_env_response"]
        hint = "higher" if not guess.isdigit() or int(guess) < int(target) else "lower"
        return [vf.UserMessage(content=hint)]

    @vf.cleanup
    async def note_cleanup(self, state) -> None:
        CLEANED.append(state["trajectory_id"])


def load_guess(max_turns: int = 5, target: str = "7") -> vf.Environment:
    data = Dataset.from_list([{"question": "Guess a number from 1 to 10.", "answer": target}])

    async def won(state, **_) -> float:
        return 1.0 if state.get("won") else 0.0

    async def fewer_turns(state, **_) -> float:
        return 1.0 / len(state["trajectory"])

    return GuessEnv(dataset=data, max_turns=max_turns, rubric=vf.Rubric(funcs=[won, fewer_turns], weights=[1.0, 0.5]))


def load_grouped(**kwargs) -> vf.Environment:
    """A rubric with a group reward function (scores a whole group at once)."""
    data = Dataset.from_list([{"question": "Say hi.", "answer": "hi"}])

    def diverse(completions, **_) -> list[float]:
        return [1.0] * len(completions)

    return vf.SingleTurnEnv(dataset=data, rubric=vf.Rubric(funcs=[diverse]))


def not_an_environment(**kwargs) -> dict:
    return {"not": "an environment"}
