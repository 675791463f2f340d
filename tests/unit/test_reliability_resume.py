"""Resume at an epoch boundary: the driver's RunSession (sampler state in the checkpoint's
trainer_state.json) continues with exactly the steps an uninterrupted run would still take,
with the same prompts — verl's "resume at the epoch boundary trains zero steps" cannot happen.

6 prompts, 2 per step, 2 epochs → 3 steps per epoch, 6 steps in all (drop_last, shuffled).
The loop below is the train flow's (flows/train.py): ``for it in range(start_iteration,
total_iterations + 1): taken = state.prompts.take(it); if taken is None: break``.
"""

from __future__ import annotations

import pytest

from flows.run_state import RunSession, open_run
from hybridflow.config import load_config
from hybridflow.data import write_rows
from hybridflow.data.tasks import make_arith
from workers.checkpoint import begin_save, commit_save


@pytest.fixture
def cfg(tmp_path):
    train = tmp_path / "train.jsonl"
    write_rows(make_arith(6, difficulty=0, seed=3), str(train))
    return load_config(None, [
        "model.path=tiny", f"data.train_files=[{train}]", "data.prompts_per_iteration=2",
        "rollout.samples_per_prompt=2", "actor.mini_batch_trajectories=4", "actor.micro_batch_trajectories=2",
        "critic.mini_batch_trajectories=4", "critic.micro_batch_trajectories=2",
        f"trainer.run_dir={tmp_path / 'runs'}", "trainer.total_epochs=2", "trainer.total_iterations=20",
        "trainer.seed=7",
    ])


def drive(state: RunSession, stop_after: int | None = None) -> list[tuple[int, list[str]]]:
    """The train flow's loop without the iteration body: (iteration, prompt uids) per step.
    ``stop_after``: write a checkpoint after that iteration and stop (the driver 'dies')."""
    steps = []
    for it in range(state.start_iteration, state.cfg.trainer.total_iterations + 1):
        taken = state.prompts.take(it)
        if taken is None:
            break
        steps.append((it, list(taken.first.load()["uid"])))
        state.last_iteration = it
        if it == stop_after:
            root = f"{state.run_dir}/checkpoints"
            begin_save(root, it)
            commit_save(root, it, state.trainer_state(it).to_dict())
            break
    return steps


@pytest.mark.parametrize("checkpoint_after, steps_left", [(3, 3), (4, 2)])
def test_resume_at_and_after_an_epoch_boundary(cfg, checkpoint_after, steps_left):
    full = drive(open_run(cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"run_id": "full"})}),
                          resume=None))
    # 2 epochs × 3 steps; each epoch uses each of the 6 prompts exactly once, in another order
    assert [it for it, _ in full] == [1, 2, 3, 4, 5, 6]
    epoch0 = sorted(u for _, uids in full[:3] for u in uids)
    epoch1 = sorted(u for _, uids in full[3:] for u in uids)
    assert epoch0 == epoch1 == sorted(f"train-{i}" for i in range(6))
    assert [u for _, uids in full[:3] for u in uids] != [u for _, uids in full[3:] for u in uids]

    interrupted = open_run(cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"run_id": "cut"})}),
                           resume=None)
    before = drive(interrupted, stop_after=checkpoint_after)
    resumed = open_run(cfg, resume=interrupted.run_dir)
    assert resumed.start_iteration == checkpoint_after + 1
    after = drive(resumed)
    # exactly the remaining steps, with the batches of the uninterrupted run
    assert len(after) == steps_left
    assert before + after == full


def test_sampler_state_saved_by_another_dataset_is_refused(cfg, tmp_path):
    """Resuming against a dataset that changed size would silently train on other batches."""
    state = open_run(cfg, resume=None)
    drive(state, stop_after=2)
    write_rows(make_arith(8, difficulty=0, seed=3), cfg.data.train_files[0])  # the file grew
    with pytest.raises(ValueError, match="num_prompts=6 but this sampler has 8"):
        open_run(cfg, resume=state.run_dir)


def test_cli_resume_without_config_continues_the_saved_run(cfg, tmp_path):
    """``hybridflow train --resume DIR`` (no -c) runs DIR's saved config — not the defaults, whose
    trainer.total_iterations=10 would change the run’s length — and
    overrides may still extend it; a folder that is not a run is a clear error."""
    from flows.preflight import PreflightError
    from flows.resume import resume_target

    short = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"total_iterations": 4, "run_id": "r"})})
    state = open_run(short, resume=None)
    got, target = resume_target(None, [], state.run_dir)
    assert target == state.run_dir and got.trainer.total_iterations == 4 and got.data == cfg.data
    assert resume_target(None, ["trainer.total_iterations=6"], state.run_dir)[0].trainer.total_iterations == 6
    assert resume_target(None, [f"trainer.run_dir={cfg.trainer.run_dir}"], "auto")[1] == state.run_dir
    with pytest.raises(PreflightError, match="is not a run directory"):
        resume_target(None, [f"trainer.run_dir={cfg.trainer.run_dir}"], str(tmp_path))
