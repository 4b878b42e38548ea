"""finetune/checkpoint/resume.py: what a resume refused for its samples per step suggests instead. batch_size is per
rank, so on another rank count the checkpoint's own batch_size would be refused again: the suggestion is the
per-rank value that makes the checkpoint's samples per step. (The recipes' refusals:
tests/recipes/test_reliability.py.)"""

import pytest

from finetune.base import BadInput
from finetune.checkpoint import resume, state_file

OPTIMIZER = "torch.optim.AdamW"


def saved(folder, *, world_size, batch_size, accum=1):
    """A recipe state file as a run of ``world_size`` ranks writes it, with its checksum beside it."""
    config = {"optimizer": OPTIMIZER, "batch_size": batch_size, "gradient_accumulation_steps": accum}
    config["world_size"] = world_size
    state = {"optimizer": {}, "config": config, "epoch": 0, "steps_in_epoch": 2, "global_step": 2}
    state_file.save(state, folder / resume.RECIPE_STATE_FILE)
    return folder


def refusal(folder, **now) -> str:
    now = {"optimizer": OPTIMIZER, "gradient_accumulation_steps": 1, **now}
    with pytest.raises(BadInput) as e:
        resume.read_resume(folder, now=now)
    return str(e.value)


@pytest.mark.parametrize(
    "before, now, suggested",
    [
        # 2 ranks of 4 saved 8 a step: on 1 rank, 8 per rank; on 4 ranks, 2 per rank
        ((2, 4), (1, 4), "8 samples per step (batch_size=8 gradient_accumulation_steps=1)"),
        ((2, 4), (4, 4), "8 samples per step (batch_size=2 gradient_accumulation_steps=1 on 4 ranks)"),
        # 1 rank of 8 saved 8: on 2 ranks, 4 per rank, not the saved 8 (16 a step)
        ((1, 8), (2, 8), "8 samples per step (batch_size=4 gradient_accumulation_steps=1 on 2 ranks)"),
    ],
)
def test_a_changed_rank_count_is_told_the_per_rank_batch_size(tmp_path, before, now, suggested):
    folder = saved(tmp_path, world_size=before[0], batch_size=before[1])
    message = refusal(folder, world_size=now[0], batch_size=now[1])
    assert "samples per step differs from the checkpoint's 8" in message
    assert f"resume with {suggested}" in message


def test_samples_the_ranks_cannot_split_name_the_run_that_saved_them(tmp_path):
    folder = saved(tmp_path, world_size=1, batch_size=3)
    message = refusal(folder, world_size=2, batch_size=3)
    assert "3 samples per step, which 2 ranks cannot split evenly" in message
    assert "(--nproc_per_node 1 with batch_size=3 gradient_accumulation_steps=1)" in message


def test_the_suggestion_is_accepted_by_the_same_check(tmp_path):
    """What the refusal suggests resumes: the same samples per step on the new rank count."""
    folder = saved(tmp_path, world_size=1, batch_size=8)
    now = {"optimizer": OPTIMIZER, "gradient_accumulation_steps": 1, "world_size": 2, "batch_size": 4}
    assert resume.read_resume(folder, now=now)["global_step"] == 2
