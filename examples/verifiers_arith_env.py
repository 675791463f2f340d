"""A verifiers environment over hybridflow's arithmetic problems, for examples/grpo_verifiers_arith.yaml.

Written the way verifiers environments are (a ``load_environment`` returning a ``vf.Environment``): a
``SingleTurnEnv`` whose dataset is ``hybridflow data arith``'s problems (question, answer) and whose rubric
is one reward function, hybridflow's own arith rule (the last number in the last ``\\boxed{}``, else the
last number; exact on numbers). The eval dataset is a second seed, so ``hybridflow data verifiers
--test-out`` holds problems generated apart from the training ones.

    hybridflow data verifiers --env examples/verifiers_arith_env.py:load_environment --n 512 \\
        --out data/verifiers_arith/train.parquet --test-out data/verifiers_arith/test.parquet --test-n 48
"""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

from hybridflow.config import RewardConfig
from hybridflow.data.tasks.arith import make_arith
from hybridflow.rewards.arith import arith_reward


def _problems(n: int, difficulty: int, seed: int) -> Dataset:
    rows = make_arith(n, difficulty=difficulty, seed=seed)
    return Dataset.from_list([{"question": r["prompt"][-1]["content"], "answer": r["reward_model"]["ground_truth"]}
                              for r in rows])  # fmt: skip


def _text(message) -> str:
    content = message["content"] if isinstance(message, dict) else message.content
    return content if isinstance(content, str) else str(content)


def correct_answer(completion, answer, **_) -> float:
    """1.0 when the reply's answer equals ``answer`` (hybridflow's arith rule), else 0.0."""
    return arith_reward(_text(completion[-1]), answer, None, RewardConfig())["score"]


def load_environment(n: int = 2048, eval_n: int = 256, difficulty: int = 0, seed: int = 0) -> vf.Environment:
    """``n`` training and ``eval_n`` evaluation problems of arith ``difficulty`` (seeds ``seed`` and
    ``seed + 1``), answered in one turn and scored by :func:`correct_answer`."""
    return vf.SingleTurnEnv(dataset=_problems(n, difficulty, seed), eval_dataset=_problems(eval_n, difficulty, seed + 1),
                            rubric=vf.Rubric(funcs=[correct_answer]))  # fmt: skip
