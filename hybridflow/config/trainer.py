"""``trainer``: the loop, checkpoints, resume, plugins, the dataflow."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from hybridflow.config.base import (
    _Section,
)
from hybridflow.config.evaluation import HarnessEvalConfig


class TrainerConfig(_Section):
    total_iterations: int = Field(10, gt=0, description="RL iterations (steps) to run.")
    total_epochs: int = Field(100, gt=0, description="Upper bound on passes over the training prompts.")
    seed: int = Field(0, description="Seed for sampling, shuffling and initialisation.")
    run_dir: str = Field("runs", description="Parent folder of run directories: a path every node sees "
                         "(a shared mount), plain (a relative path is the driver's working directory's) or as a "
                         "file:///abs/path URI; object-store URIs are refused (not supported yet).")
    run_id: str | None = Field(None, description="Run name; None = generated from time.")
    save_every: int = Field(5, ge=0, description="Checkpoint every N iterations (0 = only at the end).")
    val_every: int = Field(5, ge=0, description="Validate every N iterations (0 = never).")
    val_before_train: bool = Field(True, description="Validate the initial model.")
    eval: HarnessEvalConfig = Field(
        default_factory=HarnessEvalConfig, description="Standard-harness evaluations (lm-eval) of checkpoints during "
        "training, each a flow run of its own on a pool of its own (docs/evaluation.md); off by default.",
    )
    resume: Literal["never", "auto"] = Field("never", description="'auto' resumes the latest run in run_dir.")
    max_bad_updates: int = Field(3, gt=0, description="Stop after this many NaN/inf updates in a row.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where workers compute.")
    task_runner: Literal["ray", "thread"] = Field("ray", description="Prefect task runner.")
    dataflow: str | None = Field(
        None, description="'module:function' returning the iteration's DataFlow for a config (None = built-in)."
    )
    plugins: list[str] = Field(
        default_factory=list, description="Modules imported first; they may register estimators, losses, nodes."
    )
    # ---- asynchronous training (issue 20, docs/async.md) ----
    max_staleness: int = Field(
        0, ge=0, description="Policy versions a trajectory may lag the trainer by: 0 = the synchronous loop "
        "(rollout waits for the update); k > 0 = the rollout of iteration j generates with the weights after "
        "iteration j-1-k's update while the trainer updates, with up to k+1 rollouts in flight (1 = one-step "
        "off-policy, verl's one_step_off recipe). Needs a pool with role 'rollout' apart from the policy's.",
    )
    staleness_policy: Literal["wait", "drop"] = Field(
        "wait", description="A rollout older than trainer.max_staleness versions (e.g. the bound was lowered on "
        "a resume): 'wait' = generate it again with the trainer's current weights; 'drop' = skip its update "
        "and count its trajectories in rollout/dropped_stale.",
    )
    async_mode: Literal["auto", "off", "ahead", "stream"] = Field(
        "auto", description="How generation overlaps training (docs/async.md): 'off' = the synchronous loop; "
        "'ahead' = up to max_staleness+1 whole rollouts in flight, weights change between rollouts; 'stream' = "
        "the rollout pool generates groups continuously while the trainer trains, weights land between chunks "
        "(rollout.partial), the trainer takes whole groups from a buffer; 'auto' = 'off' with max_staleness 0, "
        "'ahead' otherwise (what configs before issue 38 meant).",
    )
    stream_order: Literal["completion", "submission"] = Field(
        "completion", description="async_mode=stream: which finished groups an iteration takes. 'completion' = the "
        "first to finish (fast; exactly-once, not bitwise reproducible); 'submission' = in the order submitted, "
        "generated on a fixed schedule of weight versions (reproducible for a seed when no fault occurs; waits "
        "more).",
    )
    stream_timeout_s: float = Field(
        600.0, gt=0, description="async_mode=stream: an iteration's take fails in one line when the rollout pool "
        "generated no token and finished no group for this many seconds (a dead or hung engine, weights that "
        "never arrived); Prefect retries the take, then the run stops resumable (verl's trainer starvation).",
    )
    weight_sync_timeout_s: float = Field(
        600.0, gt=0, description="With a rollout pool: seconds each call of a weight sync (the policy's publish, "
        "the transfer into every rollout rank, loading a version) may take per rank. A rollout rank that does not "
        "answer in time is restarted and the publish fails in one line; Prefect retries the publish_weights node "
        "against the restarted rank (which gets the version again from the policy). A policy rank that does not "
        "answer fails the publish, and after the retries the run stops resumable.",
    )
    updates_per_sync: int = Field(
        1, ge=1, description="With a rollout pool (async_mode ahead|stream): publish the policy's weights to it "
        "after every n-th iteration's update instead of after each (verl fully-async's "
        "trigger_parameter_sync_step): fewer syncs, older weights. An iteration that writes a checkpoint always "
        "publishes, so a resume starts from weights the rollout pool had. The rollout pool then lags up to n-1 "
        "versions behind before any generation ahead, so trainer.max_staleness must be at least n-1.",
    )
    weight_sync: Literal["auto", "object_store", "collective"] = Field(
        "auto", description="How the trainer's weights reach a separate rollout pool after each update: "
        "'object_store' = CPU tensors through Ray's object store; 'collective' = a torch.distributed broadcast "
        "from the policy's rank 0 to the rollout ranks (NCCL on GPUs, Gloo on CPU); 'auto' = collective when "
        "the policy pool has GPUs, else object_store (docs/async.md).",
    )
    # ---- resume from damaged storage (docs/reliability.md, Storage) ----
    resume_fallback: bool = Field(
        True, description="On resume, when the latest checkpoint does not match its manifest (truncated or changed "
        "files): resume from the newest intact checkpoint with a warning (true) or refuse to resume (false)."
    )

    @field_validator("async_mode", mode="before")
    @classmethod
    def _async_mode_from_yaml_bool(cls, v: object) -> object:
        # YAML 1.1 reads `async_mode: off` as False
        return "off" if v is False else v

    @model_validator(mode="after")
    def _eval_on_checkpoints(self) -> TrainerConfig:
        every = self.eval.every
        if every and (not self.save_every or every % self.save_every):
            raise ValueError(f"trainer.eval.every={every} evaluates checkpoints, and trainer.save_every="
                             f"{self.save_every} saves none at iteration {every}: make eval.every a multiple of "
                             "save_every")
        return self

    # ---- run directory URIs (issue 19) ----
    @field_validator("run_dir")
    @classmethod
    def _local_run_dir(cls, v: str) -> str:
        """``file:///abs/path`` (or ``file://localhost/abs/path``) becomes ``/abs/path``; a
        ``file://`` URI naming another host, and every other scheme (``s3://``, ``gs://``,
        ``memory://``, ...), fails: run state, checkpoints, locks and pool events are written with
        local file APIs, so an object store cannot hold a run yet. A plain relative path is
        resolved against the driver's working directory once, when the run opens."""
        import os
        from urllib.parse import unquote, urlsplit

        if not v.strip():
            raise ValueError("the run directory is empty; give a folder, e.g. runs")
        scheme = urlsplit(v).scheme.lower()
        if scheme == "file":
            parts = urlsplit(v)
            if parts.netloc not in ("", "localhost"):
                raise ValueError(f"a file:// URI names a path on this machine, file:///abs/path; "
                                 f"{v!r} names host {parts.netloc!r}")
            path = unquote(parts.path)
            if not path.startswith("/") or path == "/":
                raise ValueError(f"a file: URI names an absolute folder below /, file:///abs/path; {v!r} does not")
            return path
        if len(scheme) > 1 or "://" in v:  # s3://, s3:/x, memory:x (one letter + ':' would be a drive)
            raise ValueError("the run directory must be a path every node sees (a shared mount), plain or "
                             "file:///abs/path; object-store URIs are not supported for trainer.run_dir yet")
        return os.path.expanduser(v)
