"""Rows for a TextArena single-player game (``hybridflow data textarena``).

Each row is one game: its ``extra_info`` says which environment plays it (``agent_name``
``textarena``, :class:`hybridflow.agents.hubs.TextArenaEnvironment`) and with which
``env_kwargs`` (``env_id``, ``seed``). The row's prompt is the game's opening for that seed, as the
environment's ``reset`` sends it (so logs, length filters and the held-out split see the real
text); ``data_source`` is ``textarena/<env_id>``, scored by the environment
(:mod:`hybridflow.rewards.environment`); ``reward_model.ground_truth`` names the game (``"<env_id> seed
<seed>"``: the secret is the environment's, no rule reads it). Every sample of a GRPO group plays the same game.
"""

from __future__ import annotations

from typing import Any


def make_textarena(env_id: str, n: int, seed: int = 0, *, seed_offset: int = 0,
                   system_prompt: str | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """``n`` rows of the game ``env_id`` with game seeds ``seed * 1_000_000 + seed_offset + i``.

    Raises AgentLoadError (an ImportError, one line) for an unknown id or a missing textarena
    package, ValueError for n < 1.
    """
    from hybridflow.agents.hubs import TextArenaEnvironment

    if n < 1:
        raise ValueError(f"--n {n}: at least one game")
    rows = []
    for i in range(n):
        game_seed = seed * 1_000_000 + seed_offset + i
        kwargs: dict[str, Any] = {"env_id": env_id, "seed": game_seed}
        if system_prompt:
            kwargs["system_prompt"] = system_prompt
        env = TextArenaEnvironment(**kwargs)
        rows.append({
            "data_source": f"textarena/{env_id}",
            "prompt": env.reset({}),
            "ability": "game",
            "reward_model": {"style": "environment", "ground_truth": f"{env_id} seed {game_seed}"},
            "extra_info": {"generator": "textarena", "index": i, "agent_name": "textarena", "env_kwargs": kwargs},
        })  # fmt: skip
    return rows
