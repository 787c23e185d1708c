"""hetero_ddp over several epochs and across resumes: every epoch trains each sample once in its own
permutation, and a resume — at an epoch's end or mid-epoch, on the same or another number of
processes — continues the uninterrupted run's sample order.

Three launches (each costs an interpreter start): 3 epochs on 2 processes saving at the end of
epoch 0 and after step 3 (mid-epoch 1); then, on 1 process, the resume from the end of epoch 0, the
resume from step 3 (saving after step 5), a resume with another global batch and a DataLoader
without batching; then the resume from step 5 on 2 processes.
"""

import json
from collections import Counter
from pathlib import Path

import pytest

from lightning_efficient._torch import seeded_permutation
from tests.ddp import run_script

SCRIPT = Path(__file__).resolve().parent / "ddp_resume.py"
N, SEED, GLOBAL_BATCH, EPOCHS = 8, 3, 4, 3
STEPS_PER_EPOCH = N // GLOBAL_BATCH


def _launch(out, *jobs):
    run_script(SCRIPT, out, json.dumps([{"global_batch": GLOBAL_BATCH, **job} for job in jobs]), EPOCHS)


def _result(out, tag, devices):
    """The final global step and, per global step, the samples all ranks trained in it (or the error)."""
    error = out / f"{tag}_error.txt"
    if error.exists():
        return error.read_text()
    records = [json.loads((out / f"{tag}_rank{rank}.json").read_text()) for rank in range(devices)]
    assert len({r["global_step"] for r in records}) == 1
    steps = {}
    for record in records:
        for micro in record["trained"]:
            steps.setdefault(micro["step"], []).extend(micro["indices"])
            assert micro["epoch"] == micro["step"] // STEPS_PER_EPOCH
    return records[0]["global_step"], steps


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hetero_resume")
    _launch(out, {"tag": "straight", "devices": 2, "saves": ["epoch=0", "step=3"]})
    _launch(
        out,
        {"tag": "from_end", "devices": 1, "resume": str(out / "straight_epoch0.ckpt")},
        {"tag": "one", "devices": 1, "resume": str(out / "straight_step3.ckpt"), "saves": ["step=5"]},
        {"tag": "bigger", "devices": 1, "resume": str(out / "straight_step3.ckpt"), "global_batch": 2 * GLOBAL_BATCH},
        {"tag": "unbatched", "devices": 1, "no_batching": True},
        {"tag": "one_estimating", "devices": 1, "resume": str(out / "straight_step3.ckpt"), "estimates": True},
        {"tag": "from_end_estimating", "devices": 1, "resume": str(out / "straight_epoch0.ckpt"), "estimates": True},
    )
    _launch(out, {"tag": "two", "devices": 2, "resume": str(out / "one_step5.ckpt")})
    return out


def _expected(step):
    """The uninterrupted run's global batch ``step``: a slice of its epoch's permutation."""
    epoch, batch = divmod(step, STEPS_PER_EPOCH)
    permutation = seeded_permutation(N, SEED + epoch)
    return sorted(permutation[batch * GLOBAL_BATCH : (batch + 1) * GLOBAL_BATCH])


def _assert_continues(result, first):
    global_step, steps = result
    assert global_step == EPOCHS * STEPS_PER_EPOCH
    assert sorted(steps) == list(range(first, EPOCHS * STEPS_PER_EPOCH))
    for step, indices in steps.items():
        assert sorted(indices) == _expected(step), step


def test_every_epoch_trains_each_sample_once_in_its_own_permutation(runs):
    global_step, steps = _result(runs, "straight", 2)
    assert global_step == EPOCHS * STEPS_PER_EPOCH
    for epoch in range(EPOCHS):
        trained = [i for step in range(epoch * STEPS_PER_EPOCH, (epoch + 1) * STEPS_PER_EPOCH) for i in steps[step]]
        assert Counter(trained) == Counter(range(N)), epoch
    _assert_continues((global_step, steps), 0)


def test_an_end_of_epoch_resume_continues_with_the_next_epochs_permutation(runs):
    _assert_continues(_result(runs, "from_end", 1), STEPS_PER_EPOCH)


def test_a_mid_epoch_resume_on_fewer_then_more_processes_trains_the_rest_once(runs):
    """2 processes -> 1 (from step 3, saving again after step 5) -> 2: the same global batches."""
    _assert_continues(_result(runs, "one", 1), 3)
    _assert_continues(_result(runs, "two", 2), 5)


def test_a_mid_epoch_resume_with_another_global_batch_is_refused(runs):
    error = _result(runs, "bigger", 1)
    assert "mid-epoch (4 of 8 samples of epoch 1 trained) with a global batch of 4 on 2 rank(s)" in error
    assert "this run's global batch is 8" in error and "global_batch_size=4" in error


def test_a_dataloader_without_batching_is_refused_before_the_first_step(runs):
    error = _result(runs, "unbatched", 1)
    assert "batch_size=None" in error and "Give the DataLoader a batch_size" in error
    assert not list(runs.glob("unbatched_rank*.json"))


def test_a_resume_continues_where_configure_optimizers_built_the_dataloader_before_the_checkpoint_loaded(runs):
    # a new user's trial: reading trainer.estimated_stepping_batches (a OneCycleLR's total_steps) builds the training
    # DataLoader before the checkpoint is restored, and Lightning then never handed it the checkpoint's position: a
    # mid-epoch resume trained the epoch's first batches again, an end-of-epoch one replayed epoch 0's permutation
    _assert_continues(_result(runs, "one_estimating", 1), 3)
    _assert_continues(_result(runs, "from_end_estimating", 1), STEPS_PER_EPOCH)


@pytest.mark.parametrize("devices", [1, 2])
def test_a_resumed_fit_keeps_the_checkpoint_it_resumed_from(tmp_path, devices):
    # a new user's trial under hetero_fsdp: Lightning does not restore the step a ModelCheckpoint last saved at, so where
    # the caps split each step into micro-batches, the resumed fit saved again after the next step's first micro-batch,
    # still at the resumed step, over the checkpoint it resumed from (a mid-step state: a later resume from it trained
    # weights 6.1e-3 apart from the uninterrupted run's)
    run_script(Path(__file__).parent / "resume_keeps_checkpoint.py", devices, tmp_path / "out.json", timeout=240)
    found = json.loads((tmp_path / "out.json").read_text())
    # saved at the end of step 2's last micro-batch (the 4th; Lightning counts it completed after the save)
    assert found["before"]["global_step"] == 2 and found["before"]["batches"] == 3
    assert found["after"] == found["before"]


class _CrashInValidation(Exception):
    pass


def test_a_fit_resumed_mid_validation_still_saves_that_validations_checkpoint(tmp_path):
    # reviews: a resume from a checkpoint taken inside a validation (OnExceptionCheckpoint) finishes that validation at
    # the resumed step, and counting the step as saved at the fit's start skipped its monitored checkpoint (plain
    # Lightning saves it); not counting it let a checkpoint every 4 steps save a mid-step state over step 4's again
    import lightning
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_efficient._batch_counts import ResumedStepSaved

    crash = {"on": True}

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).square().mean()

        def validation_step(self, batch, batch_idx):
            if crash["on"] and self.global_step == 4 and batch_idx == 1:
                raise _CrashInValidation()
            self.log("val_loss", self.layer(batch[0]).square().mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class CountsResumedStepSaved(Callback):  # what the hetero strategies and AutoFit do
        def __init__(self):
            self.resumed = ResumedStepSaved()

        def on_train_start(self, trainer, pl_module):
            self.resumed.fit_started()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.resumed.before_batch(trainer)

    data = DataLoader(TensorDataset(torch.randn(64, 2, generator=torch.Generator().manual_seed(0))), batch_size=4)

    def fit(ckpt_path=None):
        callbacks = [ModelCheckpoint(dirpath=tmp_path / "saved", monitor="val_loss", save_top_k=-1),
                     ModelCheckpoint(dirpath=tmp_path / "every", every_n_train_steps=2, save_top_k=-1),
                     OnExceptionCheckpoint(tmp_path / "exception"), CountsResumedStepSaved()]
        trainer = lightning.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False, val_check_interval=8,
                                    accumulate_grad_batches=2, enable_model_summary=False, callbacks=callbacks,
                                    num_sanity_val_steps=0)
        trainer.fit(Module(), data, data, ckpt_path=ckpt_path)

    with pytest.raises(_CrashInValidation):
        fit()
    every_4 = tmp_path / "every" / "epoch=0-step=4.ckpt"
    before = every_4.read_bytes()
    crash["on"] = False
    fit(tmp_path / "exception" / "on_exception.ckpt")
    assert sorted(path.name for path in (tmp_path / "saved").iterdir()) == ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt"]
    assert every_4.read_bytes() == before
