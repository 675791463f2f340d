"""``reward``: rule rewards, a custom reward function, a learned reward model, a judge model."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from hybridflow.config.base import (
    _Section,
)


class RewardModelConfig(_Section):
    """A learned reward model: ``AutoModelForSequenceClassification`` with one label, scoring the
    whole conversation (Ouyang et al., "Training language models to follow instructions with human
    feedback", 2022; verl's RewardModelWorker). Off while ``path`` is None."""

    path: str | None = Field(
        None,
        description="Reward model: a local HF folder (sequence classification, num_labels=1, with its own "
        "tokenizer), a hub id in the local cache (offline), or 'tiny' (a small random model + the char "
        "tokenizer, for tests). None = no reward model.",
    )
    weight: float = Field(
        1.0, ge=0, description="Multiplier of the model's score: 'add' → rule score + weight·rm; 'replace' → weight·rm."
    )
    combine: Literal["add", "replace"] = Field(
        "add",
        description="'add': final score = rule/custom score + weight·rm score; 'replace': final score = "
        "weight·rm score and the rule/custom functions are not called.",
    )
    micro_batch_trajectories: int = Field(8, gt=0, description="Trajectories per reward-model forward.")
    max_length: int = Field(
        1024, gt=0,
        description="Longest reward-model input in its own tokens; longer rows lose tokens from the left "
        "(the prompt's start) and are counted in reward/rm_truncated.",
    )
    apply_chat_template: bool = Field(
        True,
        description="Render (prompt messages + the response as the assistant turn) with the reward model's "
        "chat template when it has one; else the plain text prompt + response.",
    )

    @model_validator(mode="after")
    def _check(self) -> RewardModelConfig:
        if self.path is None and self.combine == "replace":
            raise ValueError("reward.model.combine='replace' needs reward.model.path (no reward model is set)")
        if self.path is not None and self.weight == 0:
            raise ValueError(
                "reward.model.weight=0 with reward.model.path set: the model's score would be unused "
                "(set a weight > 0, or reward.model.path=null)"
            )
        return self

# The judge's verdict formats (hybridflow/rewards/judge.py registers a parser under each name;
# a test keeps the two lists equal). Listed here so config validation imports nothing.
JudgeVerdict = Literal["score_line", "score_tag"]
JUDGE_PLACEHOLDERS = ("{prompt}", "{response}")  # required in reward.judge.rubric; {ground_truth} optional
DEFAULT_JUDGE_RUBRIC = (
    "You are grading an answer.\n\nQuestion:\n{prompt}\n\nAnswer:\n{response}\n\n"
    "Is the answer correct and clearly written? Reply with one line 'Score: N', N an integer from 0 to 10."
)


class JudgeConfig(_Section):
    """A generative judge (LLM-as-judge: Zheng et al., "Judging LLM-as-a-Judge with MT-Bench and
    Chatbot Arena", 2023; verl's GenRM, TRL's judges): a frozen causal LM in a ``judge`` pool of its
    own, prompted with ``rubric`` per trajectory, its verdict parsed into a score in [0, 1]
    (N / max_score). Off unless ``enable``."""

    enable: bool = Field(
        False, description="Score every trajectory with the judge (needs a pool with role 'judge'); off by default."
    )
    path: str | None = Field(
        None,
        description="Judge model: a local HF folder, a cached hub id (offline), a .gguf file, "
        "'smollm2-135m-instruct' or 'tiny'. None = model.path, loaded apart from the trained weights: "
        "the initial policy, never the live one.",
    )
    rubric: str = Field(
        DEFAULT_JUDGE_RUBRIC,
        description="The judge's prompt (one user turn): must contain {prompt} and {response}; {ground_truth} is "
        "optional (the row's ground truth, '' when it has none). Say the verdict format it must answer in.",
    )
    verdict: JudgeVerdict = Field(
        "score_line",
        description="How the verdict is read: 'score_line' = the last 'Score: N' (or 'Score: N/M'); "
        "'score_tag' = the last <score>N</score>. N outside [0, max_score] or absent = unparsed.",
    )
    verdict_prefix: str = Field(
        "",
        description="Text the judge's reply is made to start with (written after the chat template's generation "
        "prompt, e.g. 'Score:'), so a small judge that does not keep to the rubric's format still answers in it; "
        "the parser reads this prefix + the generated text.",
    )
    max_score: float = Field(10.0, gt=0, description="The top of the rubric's scale; the judge score is N / max_score.")
    weight: float = Field(
        1.0, ge=0, description="Multiplier of the judge score: 'add' → score + weight·judge; 'replace' → weight·judge."
    )
    combine: Literal["add", "replace"] = Field(
        "add",
        description="'add': final score = rule/custom/reward-model score + weight·judge score; 'replace': "
        "final score = weight·judge score and the rule/custom functions are not called.",
    )
    max_new_tokens: int = Field(32, gt=0, description="Longest verdict, in judge tokens.")
    temperature: float = Field(0.0, ge=0, description="Judge sampling temperature; 0 = greedy (reproducible verdicts).")
    micro_batch_trajectories: int = Field(8, gt=0, description="Judge prompts generated together per engine batch.")
    apply_chat_template: bool = Field(
        True, description="Send the rendered rubric as a user turn of the judge's chat template when it has one; "
        "else as plain text."
    )
    engine: Literal["hf", "vllm"] = Field(
        "hf",
        description="The judge's generation engine: 'hf' (transformers, in the default runtime) or 'vllm' (the judge "
        "pool runs on the vLLM runtime, `make setup-vllm`). Not tied to rollout.engine: a vLLM judge is a second "
        "vLLM engine with a KV cache of its own (docs/rewards.md, 'Judged rewards').",
    )
    kv_cache_gib: float | None = Field(
        None, gt=0,
        description="engine=vllm on a CPU: the judge engine's KV cache in GiB (None = rollout.kv_cache_gib); it "
        "must hold one sequence of the judge's context. Not used by the hf engine.",
    )

    @model_validator(mode="after")
    def _check(self) -> JudgeConfig:
        missing = [p for p in JUDGE_PLACEHOLDERS if p not in self.rubric]
        if missing:
            raise ValueError(f"reward.judge.rubric lacks {', '.join(missing)} (it must contain "
                             f"{' and '.join(JUDGE_PLACEHOLDERS)}; {{ground_truth}} is optional)")
        if not self.enable and self.combine == "replace":
            raise ValueError("reward.judge.combine='replace' needs reward.judge.enable=true (no judge is on)")
        if self.enable and self.weight == 0:
            raise ValueError("reward.judge.weight=0 with reward.judge.enable=true: the judge's score would be unused "
                             "(set a weight > 0, or reward.judge.enable=false)")
        if self.engine == "hf" and self.kv_cache_gib is not None:
            raise ValueError(f"reward.judge.kv_cache_gib={self.kv_cache_gib:g} is for reward.judge.engine=vllm; the hf "
                             "engine has no KV cache to size (drop it, or set reward.judge.engine=vllm)")
        return self


class RewardConfig(_Section):
    function: str | None = Field(
        None,
        description="Custom reward: 'package.module:function' or 'path/to/file.py:function' "
        "(verl compute_score or TRL batched signature). None = rule rewards by data_source.",
    )
    timeout_s: float = Field(
        30.0, gt=0,
        description="Deadline for scoring one batch on one reward rank, seconds, from the start of the call "
        "(one deadline per batch, not per row): rows not scored by then are timeouts (scored on_error, "
        "counted in reward/timeouts) and the hung workers are killed and replaced.",
    )
    on_error: float = Field(
        0.0, description="Score given when the reward raises, returns NaN/None or times out; also the judge score "
        "(before reward.judge.weight) of a row whose verdict does not parse or whose judge prompt is over the "
        "judge's context.",
    )
    num_workers: int = Field(2, gt=0, description="Reward process-pool size.")
    gsm8k_extraction: Literal["strict", "flexible"] = Field(
        "flexible", description="GSM8K answer extraction: strict '#### N' or flexible last number."
    )
    format_weight: float = Field(0.0, ge=0, description="Weight of the format reward.")
    correctness_weight: float = Field(1.0, ge=0, description="Weight of the correctness reward.")
    format_style: Literal["boxed", "answer_tags", "hash"] = Field(
        "boxed", description="What the format reward looks for: \\boxed{}, <answer></answer> or '#### N'."
    )
    sandbox_memory_mb: int = Field(1024, gt=0, description="Memory limit for sandboxed code execution.")
    model: RewardModelConfig = Field(
        default_factory=RewardModelConfig, description="Learned reward model (sequence classification); off by default."
    )
    judge: JudgeConfig = Field(
        default_factory=JudgeConfig, description="Generative judge model scoring by a rubric (role 'judge'); off by default."
    )
    # ---- rule rewards for verl's data sources (issue 17) ----
    math_dapo_strict_box_verify: bool = Field(
        False,
        description="math_dapo/aime*: judge only the last \\boxed{} by exact string match "
        "(verl math_dapo strict_box_verify); False = Minerva 'Answer:' line, then \\boxed{} fallback.",
    )
    code_case_timeout_s: float = Field(
        5.0, gt=0, description="Code datasets (codecontests, apps, codeforces, taco): wall-clock limit per test case, seconds."
    )
    code_max_cases: int = Field(
        10, gt=0, description="Code datasets: test cases run per response (the first N; verl's continuous score uses 10)."
    )
    # --- failure policy (reliability round two) ---
    max_failure_iterations: int = Field(
        3, gt=0,
        description="Stop the run after this many iterations in a row in which the reward failed on every "
        "row (raised, NaN/None, timed out or crashed): training on on_error scores alone teaches nothing. "
        "Judge rows scored on_error (reward/judge_unparsed, reward/judge_overlong) do not count.",
    )
    # ---- multi-turn environment rewards (issue 16) ----
    combine: Literal["replace", "add"] = Field(
        "replace",
        description="Rows whose environment returned rewards (multi-turn): 'replace' = the score is the sum of "
        "the environment's rewards; 'add' = that sum + the rule / custom / reward-model score. Rows without "
        "environment rewards keep the rule score.",
    )

    @model_validator(mode="after")
    def _check_model(self) -> RewardConfig:
        if self.model.combine == "replace" and self.function is not None:
            raise ValueError(
                f"reward.function={self.function!r} is never called with reward.model.combine='replace'; "
                "use combine='add' or drop reward.function"
            )
        if self.judge.enable and self.judge.combine == "replace":
            if self.function is not None:
                raise ValueError(f"reward.function={self.function!r} is never called with reward.judge.combine="
                                 "'replace'; use combine='add' or drop reward.function")
            if self.model.path is not None:
                raise ValueError("reward.model.path is set but reward.judge.combine='replace' ignores every other "
                                 "score; use reward.judge.combine='add' or drop reward.model.path")
        return self
