"""PromptSampler: seeded epochs, drop_last, and exact resume across epoch boundaries."""

import json

import pytest

from hybridflow.data import PromptSampler


def _run(sampler, steps):
    return [sampler.next_indices() for _ in range(steps)]


def test_every_prompt_once_per_epoch_and_epochs_differ():
    s = PromptSampler(6, 2, shuffle=True, seed=0, drop_last=True)
    epoch0, epoch1 = _run(s, 3), _run(s, 3)
    assert sorted(i for b in epoch0 for i in b) == [0, 1, 2, 3, 4, 5]
    assert sorted(i for b in epoch1 for i in b) == [0, 1, 2, 3, 4, 5]
    assert epoch0 != epoch1  # a new permutation per epoch (fixed for seed 0)
    assert (s.epoch, s.step, s.step_in_epoch) == (2, 6, 0)


def test_same_seed_same_batches_other_seed_other_batches():
    assert _run(PromptSampler(10, 3, seed=5), 6) == _run(PromptSampler(10, 3, seed=5), 6)
    assert _run(PromptSampler(10, 3, seed=5), 6) != _run(PromptSampler(10, 3, seed=6), 6)


def test_no_shuffle_is_in_order_and_drop_last():
    # 7 prompts, 3 per step: drop_last → 2 steps/epoch, prompt 6 unused; else a last step of 1
    s = PromptSampler(7, 3, shuffle=False, drop_last=True)
    assert _run(s, 3) == [[0, 1, 2], [3, 4, 5], [0, 1, 2]]
    s = PromptSampler(7, 3, shuffle=False, drop_last=False)
    assert _run(s, 4) == [[0, 1, 2], [3, 4, 5], [6], [0, 1, 2]]
    assert len(s) == 3


@pytest.mark.parametrize("saved_after", [3, 4])
def test_resume_reproduces_the_uninterrupted_run(saved_after):
    # 6 prompts, 2 per step, 2 epochs = 6 steps. After step 3 the state sits on the epoch
    # boundary and resuming yields epoch 1's three batches; after step 4 the last two.
    full = _run(PromptSampler(6, 2, shuffle=True, seed=123, drop_last=True), 6)
    first = PromptSampler(6, 2, shuffle=True, seed=123, drop_last=True)
    assert _run(first, saved_after) == full[:saved_after]
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint as JSON
    resumed = PromptSampler(6, 2, shuffle=True, seed=123, drop_last=True)
    resumed.load_state_dict(state)
    assert resumed.epoch == 1 and resumed.step == saved_after
    assert _run(resumed, 6 - saved_after) == full[saved_after:]


def test_resume_with_iteration_per_epoch():
    full = _run(PromptSampler(6, 2, seed=1), 6)
    s = PromptSampler(6, 2, seed=1)
    assert list(s) == full[:3]  # iterating yields one epoch, then stops
    state = s.state_dict()
    t = PromptSampler(6, 2, seed=1)
    t.load_state_dict(state)
    assert list(t) == full[3:6]


def test_state_from_a_different_sampler_is_refused():
    state = PromptSampler(6, 2, seed=1).state_dict()
    with pytest.raises(ValueError, match="num_prompts=6 but this sampler has 8"):
        PromptSampler(8, 2, seed=1).load_state_dict(state)


def test_too_few_prompts():
    with pytest.raises(ValueError, match="3 prompts cannot fill one step of prompts_per_step=4"):
        PromptSampler(3, 4, drop_last=True)
    assert PromptSampler(3, 4, drop_last=False, shuffle=False).next_indices() == [0, 1, 2]
