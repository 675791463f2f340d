"""Rows for a verifiers environment (``hybridflow data verifiers``).

Each row is one example of the environment's dataset, played by the ``verifiers`` environment
(:class:`hybridflow.agents.hub_verifiers.VerifiersEnvironment`): its ``extra_info`` holds
``agent_name: verifiers`` and the ``env_kwargs`` (``env`` or ``env_id``, ``env_args``, ``split``,
``example``). The row's prompt is the opening the environment's ``reset`` gives for that example
(verifiers' own rollout up to the model's first turn: its system prompt, few-shot messages and
question), so logs, length filters and the held-out split see the real text. ``data_source`` is
``verifiers/<name>`` (scored by the environment's rubric, :mod:`hybridflow.rewards.environment`);
``reward_model.ground_truth`` names the example (``"<name> <split> example <i>"``: the answer is the
rubric's to read). Every sample of a GRPO group plays the same example.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from hybridflow.user_code import is_file_spec


def verifiers_name(env: str | None, env_id: str | None) -> str:
    """The name in ``data_source``: ``env_id``, or the spec's module stem and function
    (``"my_env.py:load_environment"`` → ``my_env``)."""
    if env_id:
        return env_id
    where = str(env).rsplit(":", 1)[0]
    stem = re.split(r"[/\\]", where)[-1].removesuffix(".py").split(".")[-1]
    return stem or "env"


def dataset_size(env_kwargs: dict[str, Any]) -> tuple[int, bool]:
    """(rows in the split's dataset, whether the environment has an eval dataset of its own)."""
    from hybridflow.agents.hub_verifiers import VerifiersEnvironment, require_verifiers

    probe = VerifiersEnvironment(**env_kwargs)
    environment = probe._environment(require_verifiers())
    environment.build_eval_dataset()
    data = environment.get_dataset() if probe.split == "train" else environment.get_eval_dataset()
    return len(data), environment.eval_dataset is not None


def make_verifiers(env: str | None = None, *, env_id: str | None = None, env_args: dict[str, Any] | None = None,
                   n: int, start: int = 0, split: str = "train") -> list[dict[str, Any]]:  # fmt: skip
    """``n`` rows: the examples ``start .. start + n - 1`` of the environment's ``split`` dataset. A
    ``file.py:name`` spec is written with the file's absolute path (environment workers may run in
    another working directory).

    Raises AgentLoadError (one line) for a missing/unloadable environment or verifiers, ValueError
    for ``n < 1`` or a range past the dataset's end.
    """
    from hybridflow.agents.environments import call_maybe_async
    from hybridflow.agents.hub_verifiers import VerifiersEnvironment

    if n < 1:
        raise ValueError(f"--n {n}: at least one example")
    if env is not None and is_file_spec(env.rsplit(":", 1)[0]):  # workers may run in another directory
        where, name = env.rsplit(":", 1)
        env = f"{Path(where).expanduser().resolve()}:{name}"
    base: dict[str, Any] = {"env": env} if env is not None else {"env_id": env_id}
    if env_args:
        base["env_args"] = dict(env_args)
    if split != "train":
        base["split"] = split
    size, _ = dataset_size(base)
    if start < 0 or start + n > size:
        raise ValueError(f"examples {start}..{start + n - 1} asked, the {split} dataset has {size} rows")
    name = verifiers_name(env, env_id)
    rows = []
    for i in range(start, start + n):
        kwargs = {**base, "example": i}
        player = VerifiersEnvironment(**kwargs)
        try:
            prompt = call_maybe_async(player.reset, {})
        finally:
            call_maybe_async(player.close)
        rows.append({
            "data_source": f"verifiers/{name}",
            "prompt": prompt,
            "ability": "environment",
            "reward_model": {"style": "environment", "ground_truth": f"{name} {split} example {i}"},
            "extra_info": {"generator": "verifiers", "index": i - start, "agent_name": "verifiers", "env_kwargs": kwargs},
        })  # fmt: skip
    return rows


__all__ = ["dataset_size", "make_verifiers", "verifiers_name"]
