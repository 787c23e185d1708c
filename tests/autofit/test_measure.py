"""Which micro-batch sizes AutoFit reads a second time: real fits of a module whose step time is set on a fake
clock (deterministic: no test asserts a real timing) and whose memory grows with the batch."""

from __future__ import annotations

import copy
import types
from typing import Any

import lightning
import pytest
import torch

from lightning_efficient import AutoFit
from lightning_efficient.autofit import BudgetTooSmall, measure
from lightning_efficient.autofit.measure import tokens_per_sample, worth_reading_again

MiB = 2**20


class Clock:
    """A ``time`` stand-in for the measuring module: its ``perf_counter`` moves only when a step says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class TimedRegression(lightning.LightningModule):
    """A step that takes ``overhead_s + per_sample_s * batch`` on ``clock`` and holds ``bytes_per_sample`` more per
    sample through it, recording every batch size its ``training_step`` sees."""

    def __init__(self, clock: Clock, overhead_s: float, per_sample_s: float, bytes_per_sample: int = 0,
                 one_off: dict[int, float] | None = None, bytes_above: dict[int, int] | None = None) -> None:
        super().__init__()
        self.one_off = dict(one_off or {})  # size -> seconds its first step costs more (a compilation on a new shape)
        self.bytes_above = dict(bytes_above or {})  # size -> bytes its steps hold beyond bytes_per_sample's
        self.layer = torch.nn.Linear(8, 1)
        self.batch_size = 16
        self.clock, self.overhead_s, self.per_sample_s, self.bytes_per_sample = clock, overhead_s, per_sample_s, bytes_per_sample
        self.sizes: list[int] = []
        self.gradients_unset: list[bool] = []  # per training_step: whether the gradients were None (set to None, not zeroed)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.sizes.append(len(x))
        self.gradients_unset.append(self.layer.weight.grad is None)
        self.clock.now += self.overhead_s + self.per_sample_s * len(x) + self.one_off.pop(len(x), 0.0)
        held = torch.ones((len(x) * self.bytes_per_sample + self.bytes_above.get(len(x), 0)) // 4)  # written: resident
        loss = torch.nn.functional.mse_loss(self.layer(x).squeeze(-1), y)
        return loss + 0 * held[-1:].sum() if len(held) else loss

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64))
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _planned_sizes(monkeypatch, budget: str, search_micro_batch: bool = True, **timing) -> tuple[list[int], AutoFit]:
    clock = Clock()
    monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    module = TimedRegression(clock, **timing)
    fit = AutoFit(budget=budget, optimizer_options=["32-bit"], search_micro_batch=search_micro_batch)
    trainer = lightning.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, callbacks=[fit])
    trainer.fit(module)
    return module.sizes[:-fit.plan.accumulation], fit  # the last micro-batches are the fit's one step


def test_each_size_is_read_once_and_only_those_that_could_overtake_the_fastest_twice(monkeypatch):
    # per sample: 16 -> 4 ms, 8 -> 6.5 ms, 4 -> 11.5 ms, 2 -> 21.5 ms, 1 -> 41.5 ms: only 16 could be picked, and a second reading
    # of it could only make it faster still
    sizes, fit = _planned_sizes(monkeypatch, "4GiB", overhead_s=0.04, per_sample_s=0.0015)
    # a one-sample warm-up; 8 and 16, each after a one-sample micro-step into gradients set to None (as an
    # accumulation window's first micro-step leaves them); the ladder below 8 once; nothing again
    assert sizes == [1, 1, 8, 1, 16, 1, 2, 4]
    assert fit.plan.ranks[0].micro_batch == 16


def test_a_size_whose_first_reading_noise_slowed_is_read_again_and_its_least_reading_kept(monkeypatch):
    # every size 2**-9 s a sample (no fixed cost a micro-step; binary fractions, so that the fake clock's sums are
    # exact and the sizes tie); 8's first reading costs 2**-11 s more (noise): 3% slower a sample, within 10% of the
    # least, so it is read again; 16, the largest of those reading the least, is not
    sizes, fit = _planned_sizes(monkeypatch, "4GiB", overhead_s=0.0, per_sample_s=2**-9, one_off={8: 2**-11})
    assert sizes == [1, 1, 8, 1, 16, 1, 2, 4, 1, 2, 4, 1, 8]
    assert fit.profiles[0].step_s == (8 * 2**-9, 16 * 2**-9)
    assert fit.plan.ranks[0].micro_batch == 16  # every size alike per sample: the largest within 3%


def test_the_second_reading_of_a_measured_size_accumulates_into_gradients_a_small_micro_step_made_after_unsetting_them(
        monkeypatch):
    # a fit's micro-step after the first of an accumulation window adds into gradients that window's first backward made
    # (Lightning sets them to None at the window's start): on CPU it peaks 2-4 MiB above one adding into gradients held
    # from before, which the first reading of each size is
    clock = Clock()
    monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    module = TimedRegression(clock, overhead_s=0.0, per_sample_s=2**-9)  # exact sums on the fake clock: the sizes tie
    trainer = lightning.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, callbacks=[AutoFit(budget="4GiB", optimizer_options=["32-bit"])])
    trainer.fit(module)
    planning = list(zip(module.sizes, module.gradients_unset))[:13]
    # every size alike per sample (no fixed cost a micro-step): 8 is read again, 16 (the largest of the least) is not
    assert planning == [(1, True), (1, True), (8, False), (1, True), (16, False), (1, False), (2, False), (4, False),
                        (1, False), (2, False), (4, False), (1, True), (8, False)]


def test_a_ladder_size_as_fast_per_sample_as_the_fastest_is_read_again(monkeypatch):
    # every size alike per sample (a binary fraction: the fake clock's sums are exact, so the sizes tie)
    sizes, _ = _planned_sizes(monkeypatch, "4GiB", overhead_s=0.0, per_sample_s=2**-9)
    # every size again but the largest of those reading the least (16, where all read alike): the ladder's alone, 8
    # after a window's first micro-step
    assert sizes == [1, 1, 8, 1, 16, 1, 2, 4, 1, 2, 4, 1, 8]


def test_the_larger_size_is_not_read_again_where_its_peak_missed_the_budget(monkeypatch):
    # 16 MiB a sample: 8 holds about 128 MiB, 16 about 256 MiB, over the 200 MiB budget; the ladder is timed against
    # 8 (6.5 ms a sample), which 4 (11.5 ms) and 2 (21.5 ms) are far above
    sizes, fit = _planned_sizes(monkeypatch, "200MiB", overhead_s=0.04, per_sample_s=0.0015, bytes_per_sample=16 * MiB)
    assert sizes == [1, 1, 8, 1, 16, 1, 2, 4, 1, 8]
    assert fit.plan.ranks[0].micro_batch == 8


@pytest.mark.parametrize(("once", "expected"), [
    ({2: 0.2, 4: 0.4, 8: 0.8, 16: 1.6}, [2, 4, 8]),  # flat per sample: any could be picked; the largest is the least
    ({2: 0.5, 4: 0.6, 8: 0.85, 16: 1.6}, [8]),  # 8 at 6% above 16's 0.1 a sample, 4 at 50%
    ({2: 0.5, 4: 0.6, 8: 1.2}, [4]),  # 16 missed the budget: 4 (0.15) as fast as 8 (0.15), 2 not
    ({2: 0.2, 4: 0.45, 8: 1.0, 16: 2.2}, []),  # the smallest the fastest per sample, the others beyond 10%
    ({2: 0.2, 4: 0.41, 8: 1.0, 16: 2.2}, [4]),
    ({4: 0.439, 8: 0.8}, [4]),  # just within 10%
    ({4: 0.441, 8: 0.8}, []),  # just beyond
    ({8: 0.8}, []),
    ({}, []),
])
def test_a_size_is_read_again_where_its_time_per_sample_is_within_ten_percent_of_the_least_but_not_the_least(once, expected):
    assert worth_reading_again(once) == expected


def test_a_measured_size_slower_per_sample_than_a_smaller_one_is_read_again():
    # the first reading on a new shape may carry a one-off cost (a compilation): no noise, so the 10% rule does not
    # hold for it; the ladder's sizes, read after the measured ones, are not checked so
    once = {2: 0.2, 4: 0.45, 8: 1.0, 16: 2.2}  # per sample 0.1, 0.1125, 0.125, 0.1375
    assert worth_reading_again(once) == []
    assert worth_reading_again(once, first_shapes=(8, 16)) == [8, 16]


def test_a_one_off_cost_on_the_larger_size_does_not_hide_it(monkeypatch):
    # 16's first step costs a second more: read once, it would be ten times slower per sample than 8 and 8 picked
    sizes, fit = _planned_sizes(monkeypatch, "4GiB", overhead_s=0.04, per_sample_s=0.0015, one_off={16: 1.0})
    assert sizes == [1, 1, 8, 1, 16, 1, 2, 4, 1, 16]  # not 8, the least per sample after the first readings
    assert fit.plan.ranks[0].micro_batch == 16


def test_a_one_off_cost_on_the_smaller_size_does_not_hide_it_where_the_larger_missed_the_budget(monkeypatch):
    sizes, fit = _planned_sizes(monkeypatch, "200MiB", overhead_s=0.04, per_sample_s=0.0015, bytes_per_sample=16 * MiB,
                                one_off={8: 1.0})
    assert sizes == [1, 1, 8, 1, 16, 1, 2, 4, 1, 8]  # not 4, the least per sample after the first readings
    assert fit.plan.ranks[0].micro_batch == 8


def test_sizes_moved_down_read_the_smaller_again_as_the_anchor_below_the_larger_that_missed(monkeypatch):
    # 64 MiB a sample and 400 MiB: 8 misses, so the sizes become 4 and 8 (8 not run again) and the ladder below 4 is
    # 1 and 2
    sizes, fit = _planned_sizes(monkeypatch, "400MiB", overhead_s=0.04, per_sample_s=0.0015, bytes_per_sample=64 * MiB)
    assert sizes == [1, 1, 8, 1, 4, 1, 2, 1, 4]
    assert fit.profiles[0].sizes == (4, 8) and fit.plan.ranks[0].micro_batch == 4


def test_sizes_move_down_while_the_smaller_misses_the_budget_less_the_margin_not_only_the_budget(monkeypatch):
    # 64 MiB a sample and 560 MiB: 8 (about 512 MiB) is within the budget but not within it less the margin (504 MiB),
    # where no plan may peak; measured at 8 and 16, small micro-batches were predicted from a line through sizes no
    # plan runs at, and the budget a refusal named was refused in turn
    sizes, fit = _planned_sizes(monkeypatch, "560MiB", overhead_s=0.04, per_sample_s=0.0015, bytes_per_sample=64 * MiB)
    assert sizes[:5] == [1, 1, 8, 1, 4]
    assert fit.profiles[0].sizes == (4, 8) and fit.plan.ranks[0].micro_batch == 4


def test_a_size_read_above_the_budget_less_the_margin_before_the_sizes_moved_below_it_stays_in_the_memory_model(monkeypatch):
    # 64 MiB a sample and 250 MiB: 8 and then 4 miss (225 MiB usable), so the sizes become 2 and 4; the reading of 8
    # is kept, and a micro-batch of 8 (a plan recomputing its blocks there) is predicted from it, not from the line
    # through 2 and 4 (the benchmark's Llama: 120 MiB predicted at 8 from 2 and 4, 99 read)
    sizes, fit = _planned_sizes(monkeypatch, "250MiB", overhead_s=0.04, per_sample_s=0.0015, bytes_per_sample=64 * MiB)
    assert sizes[:5] == [1, 1, 8, 1, 4]
    profile = fit.profiles[0]
    assert profile.sizes == (2, 4) and [size for size, _ in profile.peak_points()] == [2, 4, 8]
    read_at_8 = dict(profile.peak_points())[8]
    assert profile.peak_at(8) == read_at_8 and 7 * 64 * MiB < read_at_8 < 10 * 64 * MiB
    assert (8, pytest.approx(0.04 + 8 * 0.0015)) in profile.time_points()


def test_one_size_where_the_micro_batch_is_not_searched_is_read_twice(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    module = TimedRegression(clock, overhead_s=0.04, per_sample_s=0.0015)
    fit = AutoFit(budget="4GiB", optimizer_options=["32-bit"], search_micro_batch=False)
    trainer = lightning.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, callbacks=[fit])
    trainer.fit(module)
    # the warm-up; 16 twice, each after a one-sample micro-step into gradients set to None
    assert list(zip(module.sizes, module.gradients_unset))[:5] == [(1, True), (1, True), (16, False), (1, True), (16, False)]
    assert module.sizes[5:] == [16] and fit.profiles[0].sizes == (16, 16)


def test_in_lockstep_every_rank_reads_every_size_twice_whatever_its_readings(monkeypatch):
    # under FSDP2 (or a SyncBatchNorm under DDP) the steps must not follow a rank's own readings: the larger size is
    # read even where it missed the budget, and every size again
    monkeypatch.setattr(measure, "_in_lockstep", lambda module: True)
    for budget, bytes_per_sample in (("4GiB", 0), ("200MiB", 16 * MiB)):
        sizes, _ = _planned_sizes(monkeypatch, budget, overhead_s=0.04, per_sample_s=0.0015, bytes_per_sample=bytes_per_sample)
        assert sizes == [2, 2, 8, 2, 16, 2, 4, 2, 4, 2, 8, 2, 16], budget


def test_in_lockstep_every_size_is_read_again():
    # under FSDP2 (or a SyncBatchNorm under DDP) every rank must run the same steps, whatever its own readings say
    assert worth_reading_again({2: 0.5, 4: 0.6, 8: 0.85, 16: 1.6}, lockstep=True) == [2, 4, 8, 16]


def _lockstep_on_rank(rank: int, store: str, results: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        synced = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SyncBatchNorm(4))
        plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        with open(f"{results}.{rank}", "w") as out:
            out.write(f"{measure._in_lockstep(synced)} {measure._in_lockstep(plain)}")
    finally:
        torch.distributed.destroy_process_group()


def test_a_sync_batchnorm_in_a_distributed_run_puts_the_ranks_in_lockstep(tmp_path):
    # its forward gathers statistics from every rank: a rank's own readings may not decide what it runs
    synced = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SyncBatchNorm(4))
    assert not measure._in_lockstep(synced)  # one process: nothing to keep in step
    torch.multiprocessing.spawn(_lockstep_on_rank, args=(str(tmp_path / "store"), str(tmp_path / "out")), nprocs=2)
    assert [(tmp_path / f"out.{rank}").read_text() for rank in (0, 1)] == ["True False", "True False"]


class WithBatchNorm(TimedRegression):
    """A BatchNorm over the batch: it cannot train on one sample."""

    def __init__(self, clock: Clock, batch_size: int) -> None:
        super().__init__(clock, overhead_s=0.04, per_sample_s=0.0015)
        self.norm = torch.nn.BatchNorm1d(8)
        self.batch_size = batch_size

    def training_step(self, batch, batch_idx):
        x, y = batch
        return super().training_step((self.norm(x), y), batch_idx)


@pytest.mark.parametrize("loader_batch", [16, 4])
def test_a_model_that_cannot_train_on_one_sample_is_measured_and_trains(monkeypatch, loader_batch):
    # measuring never runs one sample unless the readings themselves go down to one (a budget that tight); with a
    # loader batch of 4 (x 4 accumulated) the pick, 16 (the fastest per sample here), is read beyond the measured sizes
    clock = Clock()
    monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    module = WithBatchNorm(clock, loader_batch)
    fit = AutoFit(budget="4GiB", optimizer_options=["32-bit"])
    trainer = lightning.Trainer(accelerator="cpu", max_steps=2, accumulate_grad_batches=16 // loader_batch, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[fit])
    trainer.fit(module)
    assert trainer.global_step == 2 and fit.plan.micro_batches == [16]
    assert min(module.sizes) >= 2
    if loader_batch == 4:  # the pick's reading joins the memory model beside the measured sizes
        assert fit.profiles[0].sizes == (2, 4) and [size for size, _ in fit.profiles[0].peak_points()] == [2, 4, 16]


def test_a_pick_between_larger_sizes_read_is_read_too(monkeypatch):
    # a review: a pick between the measured sizes and a larger size read was predicted from the line between the two
    # readings and not read (a peak growing more slowly at larger sizes is above that line). Loader batch 4 x 6: sizes
    # 2 and 4; the fastest per sample, 24, is read beyond them and holds 1 GiB more (above the budget less the margin),
    # so the pick moves to 12, predicted between 4 and 24, and read before the first step
    clock = Clock()
    monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    module = TimedRegression(clock, overhead_s=0.04, per_sample_s=0.0015, bytes_per_sample=4 * MiB, bytes_above={24: 1024 * MiB})
    module.batch_size = 4
    fit = AutoFit(budget="1GiB", optimizer_options=["32-bit"])
    trainer = lightning.Trainer(accelerator="cpu", max_steps=1, accumulate_grad_batches=6, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, callbacks=[fit])
    trainer.fit(module)
    profile = fit.profiles[0]
    assert fit.plan.micro_batches == [12] and profile.sizes == (2, 4)
    read = dict(profile.peak_points())
    assert sorted(read) == [2, 4, 12, 24] and read[12] < 100 * MiB < 1024 * MiB < read[24]
    assert any("read above its prediction (24: peak)" in note for note in fit.plan.notes), fit.plan.notes


def _batchnorm_fit(monkeypatch, budget: str, bytes_per_sample: int) -> tuple[lightning.Trainer, AutoFit, WithBatchNorm]:
    clock = Clock()
    monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    module = WithBatchNorm(clock, 16)
    module.bytes_per_sample = bytes_per_sample
    fit = AutoFit(budget=budget, optimizer_options=["32-bit"])
    trainer = lightning.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, callbacks=[fit])
    return trainer, fit, module


def test_a_model_that_cannot_train_on_one_sample_is_refused_with_the_budget_it_needs_not_a_measuring_error(monkeypatch):
    # 64 MiB a sample and 100 MiB: even 2 samples miss, and one sample fails in its BatchNorm; the search then
    # leaves micro-batch 1 out and refuses the budget before the first step (it was "AutoFit could not measure")
    trainer, _, module = _batchnorm_fit(monkeypatch, "100MiB", 64 * MiB)
    with pytest.raises(BudgetTooSmall, match="micro-batch 2"):
        trainer.fit(module)
    assert trainer.global_step == 0


def test_a_model_that_cannot_train_on_one_sample_gets_a_plan_of_two_where_two_fit(monkeypatch):
    # 64 MiB a sample and 240 MiB: 8 and 4 miss, 2 fits (about 128 MiB): no need to try one sample
    trainer, fit, module = _batchnorm_fit(monkeypatch, "240MiB", 64 * MiB)
    trainer.fit(module)
    assert fit.plan.ranks[0].micro_batch == 2 and trainer.global_step == 1


class CachedOptimizer(TimedRegression):
    """``configure_optimizers`` returns one AdamW for every fit, which the first fit leaves holding state."""

    def configure_optimizers(self):
        if not hasattr(self, "optimizer"):
            self.optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        return self.optimizer


class StatesAtStart(lightning.Callback):
    """The optimizer's state when training starts (after AutoFit measured)."""

    def on_train_start(self, trainer, pl_module):
        self.state = {k: v.clone() for k, v in trainer.optimizers[0].state[pl_module.layer.weight].items()}


def _second_fit(autofit: bool, monkeypatch=None) -> tuple[CachedOptimizer, dict, dict, list[int]]:
    torch.manual_seed(0)
    module = CachedOptimizer(Clock(), overhead_s=0.0, per_sample_s=0.0)
    trainer = lightning.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False)
    trainer.fit(module)
    before = {k: v.clone() for k, v in module.optimizer.state[module.layer.weight].items()}
    held: list[int] = []
    if monkeypatch is not None:  # what measuring leaves out of its readings as held only while it measures
        not_counting = measure._not_counting
        monkeypatch.setattr(measure, "_not_counting", lambda meter, held_bytes: held.append(held_bytes) or not_counting(meter, held_bytes))
    seen = StatesAtStart()
    callbacks = [AutoFit(budget="4GiB", optimizer_options=["32-bit"], search_micro_batch=False), seen] if autofit else [seen]
    trainer = lightning.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, callbacks=callbacks)
    trainer.fit(module)
    return module, before, seen.state, held


def test_an_optimizer_holding_state_before_the_fit_finds_it_as_it_was_after_measuring_and_trains_as_plain_lightning(
        monkeypatch):
    # measuring steps the optimizer; its states are put back from a copy in host memory (on CUDA a copy on the
    # device read in every peak measured), whose bytes (on CPU resident while measuring) are not the plan's
    module, before, at_start, held = _second_fit(autofit=True, monkeypatch=monkeypatch)
    assert before.keys() == at_start.keys() and all(torch.equal(before[k], at_start[k]) for k in before)
    plain, _, _, _ = _second_fit(autofit=False)
    assert torch.equal(module.layer.weight, plain.layer.weight)
    state_bytes = sum(v.numel() * v.element_size() for s in module.optimizer.state.values() for v in s.values())
    assert held and all(h == measure._backup_bytes(module, torch.device("cpu")) + state_bytes for h in held)


def test_only_optimizers_keeping_their_state_as_torchs_own_have_it_copied_to_host_memory():
    import bitsandbytes as bnb

    class OwnLoad(torch.optim.AdamW):
        def load_state_dict(self, state_dict):
            super().load_state_dict(state_dict)

    params = [torch.nn.Parameter(torch.ones(4))]
    assert measure._torch_state_handling(torch.optim.AdamW(params))
    assert not measure._torch_state_handling(OwnLoad(params))  # its state may be more than state and param_groups
    assert not measure._torch_state_handling(bnb.optim.AdamW8bit(params))  # its load moves only some of its states


OPTIMIZERS = {
    "adamw, a tensor lr": lambda params: torch.optim.AdamW(params, lr=torch.tensor(1e-2)),
    "adam, fused": lambda params: torch.optim.Adam(params, lr=1e-2, fused=True),
    "sgd, momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
    "sgd, no momentum (a None buffer)": lambda params: torch.optim.SGD(params, lr=1e-2),
    "asgd (0-dim states)": lambda params: torch.optim.ASGD(params, lr=1e-2),
    "lbfgs (lists of tensors)": lambda params: torch.optim.LBFGS(params, lr=0.1, history_size=3),
}


@pytest.mark.parametrize(("name", "dtype"), [(name, dtype) for name in OPTIMIZERS for dtype in (torch.float32, torch.bfloat16)
                                             if not (name.startswith("lbfgs") and dtype is torch.bfloat16)])
def test_an_optimizers_state_copied_to_host_memory_comes_back_as_it_was(name, dtype):
    # every state (a 0-dim float32 one beside bf16 parameters, which load_state_dict would cast), the param_groups
    # (a tensor lr) come back alike; the copy shares nothing with the live states, which the step after it changes
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(8, 4, dtype=dtype))
    target = torch.randn(8, 4, dtype=dtype)
    optimizer = OPTIMIZERS[name]([param])

    def step() -> None:
        def closure():
            optimizer.zero_grad()
            loss = ((param - target) ** 2).sum()
            loss.backward()
            return loss

        optimizer.step(closure)

    for _ in range(2):
        step()
    expected = copy.deepcopy(optimizer.state_dict())
    saved = measure.SavedOptimizerState(optimizer)
    state_bytes = sum(v.numel() * v.element_size() for v in torch.utils._pytree.tree_leaves(expected["state"])
                      if isinstance(v, torch.Tensor))
    assert saved.direct and saved.host_bytes == state_bytes
    step()  # as measuring does
    saved.restore()
    assert_same_state(optimizer.state_dict(), expected)
    assert all(v.device == param.device for v in optimizer.state[param].values() if isinstance(v, torch.Tensor))


def assert_same_state(got: Any, expected: Any) -> None:
    """Equal nested states: tensors of the same dtype and values, the rest equal."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype and torch.equal(got, expected)
    elif isinstance(expected, dict):
        assert got.keys() == expected.keys()
        for key in expected:
            assert_same_state(got[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            assert_same_state(g, e)
    else:
        assert got == expected


def test_tokens_per_sample_reads_the_token_rows_not_a_one_dimensional_index_before_them():
    # a new user's trial: a batch whose first tensor is the samples' index counted one token a sample, and the plan's
    # tokens/s were its samples/s
    batch = {"idx": torch.arange(4), "input_ids": torch.zeros(4, 32, dtype=torch.long), "labels": torch.zeros(4, 32)}
    assert tokens_per_sample(batch) == 32
    assert tokens_per_sample((torch.arange(4),)) is None  # nothing but an index: no tokens, the rate is in samples
    # the review: a Hugging Face BatchEncoding (a UserDict) was not looked into; a float mask before the ids does not
    # decide; tensors whose rows are not the samples (packed 1-D ids with [1, N] positions, images) read as before
    from transformers import BatchEncoding

    encoded = BatchEncoding({"attention_mask": torch.ones(4, 16), "input_ids": torch.zeros(4, 16, dtype=torch.long)})
    assert tokens_per_sample(encoded) == 16
    assert tokens_per_sample({"input_ids": torch.zeros(64, dtype=torch.long), "position_ids": torch.zeros(1, 64)}) is None
    assert tokens_per_sample({"labels": torch.zeros(4), "pixel_values": torch.zeros(4, 3, 8, 8)}) is None
    # a later trial: an MLP's float feature columns were counted as its tokens (its "tokens/s" its features/s)
    assert tokens_per_sample({"x": torch.randn(4, 20), "y": torch.randint(0, 3, (4,))}) is None
    assert tokens_per_sample((torch.randn(4, 20), torch.zeros(4, 20, dtype=torch.bool))) is None
    # its review: class labels or one-hot labels beside features, uint8 images, int16 audio are not ids; a bool mask
    # before the ids does not hide them
    long = torch.long
    assert tokens_per_sample((torch.randn(4, 20), torch.zeros(4, 1, dtype=long))) is None
    assert tokens_per_sample({"x": torch.randn(4, 20), "y": torch.zeros(4, 5, dtype=long)}) is None
    assert tokens_per_sample((torch.zeros(4, 3, 8, 8, dtype=torch.uint8), torch.zeros(4, dtype=long))) is None
    assert tokens_per_sample({"wave": torch.zeros(4, 16000, dtype=torch.int16)}) is None
    assert tokens_per_sample((torch.ones(4, 16, dtype=torch.bool), torch.zeros(4, 16, dtype=long))) == 16
    assert tokens_per_sample({"attention_mask": torch.ones(4, 16, dtype=torch.bool), "input_ids": torch.zeros(4, 16, dtype=long)}) == 16
    assert tokens_per_sample({"pixel_values": torch.randn(4, 3, 8, 8), "input_ids": torch.zeros(4, 7, dtype=torch.int32)}) == 7
