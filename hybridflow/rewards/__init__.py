"""Rewards: rule rewards selected by ``data_source`` — every source verl's
``default_compute_score`` routes (gsm8k, the MATH family, math_dapo/aime*, numina_*, code
contests, geometry3k, Search-R1) plus arith and countdown, each judged on the final answer — the
format reward, custom reward functions (verl / TRL signatures), a crash-proof process-pool
executor, and a sandbox for running model-written code.

See docs/rewards.md. Nothing here imports torch.
"""

from hybridflow.rewards.executor import (
    FAILURE_METRICS,
    RewardExecutor,
    RewardItem,
    RewardResults,
    RewardWorkerError,
)
from hybridflow.rewards.extract import (
    extract_answer_line,
    extract_answer_tags,
    extract_boxed,
    extract_hash_answer,
    last_number,
    parse_number,
)
from hybridflow.rewards.format import format_score, register_format_style
from hybridflow.rewards.loader import RewardFunction, RewardLoadError, load_reward_function
from hybridflow.rewards.registry import (
    UnknownDataSourceError,
    default_compute_score,
    get_reward,
    register_reward,
    reward_names,
    reward_prefixes,
)

__all__ = [
    "default_compute_score",
    "register_reward",
    "get_reward",
    "reward_names",
    "reward_prefixes",
    "UnknownDataSourceError",
    "extract_boxed",
    "extract_answer_line",
    "extract_answer_tags",
    "extract_hash_answer",
    "last_number",
    "parse_number",
    "format_score",
    "register_format_style",
    "load_reward_function",
    "RewardFunction",
    "RewardLoadError",
    "RewardExecutor",
    "RewardItem",
    "RewardResults",
    "RewardWorkerError",
    "FAILURE_METRICS",
]
