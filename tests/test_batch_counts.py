"""Lightning's restored batch counts moved to a step's first micro-batch, against Lightning's own loop."""

import lightning
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_efficient._batch_counts import restored_position_moved_to_the_batchs_start


class SaveInside(lightning.Callback):
    """Save a checkpoint in ``on_train_batch_end`` of the epoch's ``after``-th batch, then stop the fit."""

    def __init__(self, path, after):
        self.path, self.after = path, after

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx + 1 == self.after:
            trainer.save_checkpoint(self.path)
            raise RuntimeError("stopped after the save")


class Steps(lightning.Callback):
    """Each training batch's index, with the optimizer steps and the logger's steps before it; the move made."""

    def __init__(self, per_batch):
        self.per_batch, self.moved, self.seen = per_batch, None, []

    def on_train_start(self, trainer, pl_module):
        self.moved = restored_position_moved_to_the_batchs_start(trainer, self.per_batch)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append((batch_idx, trainer.global_step, trainer.fit_loop.epoch_loop._batches_that_stepped))


@pytest.mark.parametrize("after", [5, 6, 7, 8])
@pytest.mark.parametrize("per_batch", [4, 2])
def test_a_checkpoint_saved_inside_a_batch_resumes_at_its_first_micro_batch_with_the_loggers_step_in_step(tmp_path, after,
                                                                                                         per_batch):
    # 4 micro-batches a step: one batch of the user's split in 4, or two in 2 (the user's own accumulation of 2); the
    # review: saved in on_train_batch_end, Lightning counted the logger a step more on the restart, one ahead of
    # global_step for the rest of the fit
    settings = dict(accelerator="cpu", max_steps=3, accumulate_grad_batches=4, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    path = tmp_path / "inside.ckpt"
    with pytest.raises(RuntimeError, match="stopped after the save"):
        lightning.Trainer(callbacks=[SaveInside(path, after)], **settings).fit(BoringModel())
    steps = Steps(per_batch)
    lightning.Trainer(callbacks=[steps], **settings).fit(BoringModel(), ckpt_path=path)
    start = after // per_batch * per_batch  # the batch's first micro-batch
    if start == after:  # at a batch's end: nothing moves
        assert steps.moved is None
    else:
        assert steps.moved == (after - start, per_batch)
    # the batch trains from its first micro-batch; the logger's step is global_step throughout, as in an uninterrupted fit
    assert [index for index, _, _ in steps.seen] == list(range(start, 12))
    assert all(stepped == global_step for _, global_step, stepped in steps.seen)
    assert [global_step for index, global_step, _ in steps.seen] == [index // 4 for index in range(start, 12)]
