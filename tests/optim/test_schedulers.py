"""Schedulers keep driving the 8-bit twin exactly as they drive the module's own optimizer.

Each case fits the same tiny module twice: plain Lightning with the 32-bit optimizer, and with
``EightBitOptimizer``. The scheduled hyperparameters (read from the param groups of the optimizer
being stepped) and the ones bitsandbytes actually uses (read from its ``get_config`` for each
group) must follow the plain run's trajectory step for step, and torch's "optimizer.step() has been
overridden" warning must not appear.
"""

import warnings

import bitsandbytes as bnb
import lightning
import pytest
import torch
from torch.optim import lr_scheduler

from lightning_efficient import EightBitOptimizer
from tests.optim.helpers import Regression, dataset, trainer

_OVERRIDDEN = "overridden after learning rate scheduler initialization"


class Scheduled(Regression):
    """Two param groups (the second at half the learning rate) and a scheduler built by ``make_scheduler``."""

    def __init__(self, make_optimizer, make_scheduler, interval="step", monitor=None):
        super().__init__()
        self.make_optimizer, self.make_scheduler, self.interval, self.monitor = make_optimizer, make_scheduler, interval, monitor

    def configure_optimizers(self):
        groups = [
            {"params": list(self.hidden.parameters())},
            {"params": [*self.embed.parameters(), *self.out.parameters()], "lr": self.lr / 2},
        ]
        optimizer = self.make_optimizer(groups, self.lr)
        config = {"scheduler": self.make_scheduler(optimizer), "interval": self.interval}
        if self.monitor:
            config["monitor"] = self.monitor
        return {"optimizer": optimizer, "lr_scheduler": config}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))

    def val_dataloader(self):
        return torch.utils.data.DataLoader(dataset(16, seed=1), batch_size=16)


_KEYS = ("lr", "betas", "momentum", "weight_decay")


class Trajectory(lightning.Callback):
    """Per step: the scheduled hyperparameters of every group of the optimizer being stepped and,
    for a bitsandbytes optimizer, the ``lr`` and ``betas`` it updates each group's first parameter with."""

    def __init__(self):
        self.scheduled: list[list[dict]] = []
        self.used: list[tuple[int, float, tuple]] = []

    def on_train_start(self, trainer, pl_module):
        optimizer = trainer.optimizers[0]
        if not isinstance(optimizer, bnb.optim.optimizer.Optimizer8bit):
            return
        update_step = optimizer.update_step

        def recording(group, p, gindex, pindex):
            if pindex == 0:  # what bitsandbytes reads for this update
                config = optimizer.get_config(gindex, pindex, group)
                self.used.append((gindex, config["lr"], tuple(config["betas"])))
            return update_step(group, p, gindex, pindex)

        optimizer.update_step = recording

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        groups = trainer.optimizers[0].param_groups
        self.scheduled.append([{k: g[k] for k in _KEYS if k in g} for g in groups])


def _same_keys(ours, plain):
    """``ours`` with only the keys the plain run's groups have (the twin of SGD also holds bitsandbytes' betas)."""
    return [[{k: g[k] for k in p} for g, p in zip(o, ps)] for o, ps in zip(ours, plain)]


def _fit(model_fn, eight_bit, steps=None, **kwargs):
    trajectory = Trajectory()
    callbacks = [trajectory] + ([EightBitOptimizer(min_8bit_size=1024)] if eight_bit else [])
    t = trainer(steps if steps is not None else -1, callbacks, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(model_fn())
    return t, trajectory, [str(w.message) for w in caught]


def _adamw(groups, lr):
    return torch.optim.AdamW(groups, lr=lr, weight_decay=0.05)


def _sgd(groups, lr):
    return torch.optim.SGD(groups, lr=lr, momentum=0.9)


CASES = {
    "lambda_warmup": (_adamw, lambda o: lr_scheduler.LambdaLR(o, lambda step: min(1.0, (step + 1) / 6)), 7),
    "sequential_linear_then_cosine": (
        _adamw,
        lambda o: lr_scheduler.SequentialLR(
            o, [lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=3), lr_scheduler.CosineAnnealingLR(o, T_max=5)], milestones=[3]
        ),
        9,
    ),
    "chained_linear_and_exponential": (
        _adamw,
        lambda o: lr_scheduler.ChainedScheduler([lr_scheduler.LinearLR(o, start_factor=0.2, total_iters=4), lr_scheduler.ExponentialLR(o, 0.9)]),
        7,
    ),
    "nested_sequential_in_chained": (
        _sgd,
        lambda o: lr_scheduler.ChainedScheduler([
            lr_scheduler.SequentialLR(o, [lr_scheduler.ConstantLR(o, 0.5, total_iters=2), lr_scheduler.ExponentialLR(o, 0.8)], milestones=[2]),
            lr_scheduler.MultiplicativeLR(o, lambda step: 0.95),
        ]),
        6,
    ),
    "one_cycle_adamw_lr_and_betas": (_adamw, lambda o: lr_scheduler.OneCycleLR(o, max_lr=[0.02, 0.01], total_steps=8), 8),
    "one_cycle_sgd_lr_and_momentum": (_sgd, lambda o: lr_scheduler.OneCycleLR(o, max_lr=[0.05, 0.02], total_steps=8), 8),
    "cyclic_sgd_lr_and_momentum": (_sgd, lambda o: lr_scheduler.CyclicLR(o, base_lr=0.001, max_lr=0.05, step_size_up=3), 7),
}


@pytest.mark.parametrize("case", list(CASES))
def test_scheduled_hyperparameters_reach_the_8bit_twin_every_step(case):
    make_optimizer, make_scheduler, steps = CASES[case]

    def model():
        return Scheduled(make_optimizer, make_scheduler)

    _, plain, plain_warnings = _fit(model, eight_bit=False, steps=steps)
    t, ours, our_warnings = _fit(model, eight_bit=True, steps=steps)
    assert isinstance(t.optimizers[0], bnb.optim.optimizer.Optimizer8bit)
    assert len(plain.scheduled) == steps
    # the schedule does change something, and the twin's param groups follow it exactly
    assert len({tuple(g["lr"] for g in step) for step in plain.scheduled}) > 2
    assert _same_keys(ours.scheduled, plain.scheduled) == plain.scheduled
    # and bitsandbytes uses those values: lr, and momentum or Adam's betas (bitsandbytes' betas[0])
    assert len(ours.used) == 2 * steps
    for (gindex, lr, betas), step in zip(ours.used, [s for s in plain.scheduled for _ in (0, 1)]):
        group = step[gindex]
        assert lr == group["lr"]
        if "betas" in group:
            assert betas == tuple(group["betas"])
        else:
            assert betas[0] == group["momentum"]
    assert not [m for m in our_warnings if _OVERRIDDEN in m], our_warnings
    assert not [m for m in plain_warnings if _OVERRIDDEN in m]


def test_reduce_on_plateau_monitoring_a_validation_metric_reduces_the_twins_lr():
    def model():
        # a threshold no epoch can beat: every epoch after the first is "bad", so the lr halves each time
        return Scheduled(
            _adamw,
            lambda o: lr_scheduler.ReduceLROnPlateau(o, mode="min", factor=0.5, patience=0, threshold=1e9, threshold_mode="abs"),
            interval="epoch",
            monitor="val_loss",
        )

    kwargs = {"max_epochs": 4, "limit_train_batches": 2, "limit_val_batches": 1, "num_sanity_val_steps": 0}
    _, plain, _ = _fit(model, eight_bit=False, **kwargs)
    t, ours, our_warnings = _fit(model, eight_bit=True, **kwargs)
    assert isinstance(t.optimizers[0], bnb.optim.AdamW8bit)
    assert [s[0]["lr"] for s in plain.scheduled] == [1e-2, 1e-2, 1e-2, 1e-2, 5e-3, 5e-3, 2.5e-3, 2.5e-3]
    assert _same_keys(ours.scheduled, plain.scheduled) == plain.scheduled
    assert [lr for gindex, lr, _ in ours.used if gindex == 0] == [s[0]["lr"] for s in plain.scheduled]
    assert t.optimizers[0].param_groups[0]["lr"] == 1.25e-3  # the last epoch's reduction reached the twin
    assert not [m for m in our_warnings if _OVERRIDDEN in m]


def test_a_run_resumed_mid_schedule_continues_the_sequential_schedule_on_the_twin(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    make_optimizer, make_scheduler, _ = CASES["sequential_linear_then_cosine"]
    straight, resumed = Trajectory(), Trajectory()
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    trainer(6, [straight, EightBitOptimizer(min_8bit_size=1024), saver], enable_checkpointing=True).fit(
        Scheduled(make_optimizer, make_scheduler)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(6, [resumed, EightBitOptimizer(min_8bit_size=1024)]).fit(
            Scheduled(make_optimizer, make_scheduler), ckpt_path=tmp_path / "step=2.ckpt"
        )
    # plain torch: the learning rates of the 6 steps
    module = Scheduled(make_optimizer, make_scheduler)
    reference = module.configure_optimizers()
    expected = []
    for _ in range(6):
        expected.append([g["lr"] for g in reference["optimizer"].param_groups])
        reference["optimizer"].step()
        reference["lr_scheduler"]["scheduler"].step()
    assert [[g["lr"] for g in step] for step in straight.scheduled] == expected
    # steps 3..6 cross the milestone (3) from LinearLR into CosineAnnealingLR
    assert resumed.scheduled == straight.scheduled[2:]
    assert resumed.used == straight.used[4:]
    assert not [w for w in caught if _OVERRIDDEN in str(w.message)]


def test_rebind_schedulers_without_a_trainer_follows_plain_torch():
    from lightning_efficient.optim import build_twin, rebind_schedulers

    def setup():
        params = [torch.nn.Parameter(torch.randn(64, 64, generator=torch.Generator().manual_seed(0)))]
        optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        inner = lr_scheduler.SequentialLR(
            optimizer, [lr_scheduler.LinearLR(optimizer, 0.25, total_iters=2), lr_scheduler.ExponentialLR(optimizer, 0.5)], milestones=[2]
        )
        return params, optimizer, lr_scheduler.ChainedScheduler([inner, lr_scheduler.MultiplicativeLR(optimizer, lambda _: 0.9)])

    params, optimizer, scheduler = setup()
    expected = []
    for _ in range(6):
        params[0].grad = torch.ones_like(params[0])
        optimizer.step()
        scheduler.step()
        expected.append(optimizer.param_groups[0]["lr"])

    params, optimizer, scheduler = setup()
    twin = build_twin(optimizer, min_8bit_size=4096, paged=False)
    lr_before = optimizer.param_groups[0]["lr"]
    assert rebind_schedulers([scheduler], optimizer, twin) == 5  # the chain, the sequence and its two, the multiplicative
    got = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(6):
            params[0].grad = torch.ones_like(params[0])
            twin.step()
            scheduler.step()
            got.append(twin.param_groups[0]["lr"])
    assert got == expected
    assert optimizer.param_groups[0]["lr"] == lr_before  # the replaced optimizer is no longer scheduled
    assert not caught, [str(w.message) for w in caught]


def test_rebinding_a_scheduler_gives_no_initial_lr_to_a_group_that_had_none():
    # a new user's trial: the step-tracking patch is applied by building a scheduler, which gave every group of the
    # module's optimizer an initial_lr after an 8-bit fit, also a group BaseFinetuning had added (none in plain torch),
    # and a new scheduler built on it later started that group from the stale value
    from lightning_efficient.optim import build_twin, rebind_schedulers

    first, added = torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(64, 64))
    optimizer = torch.optim.AdamW([first], lr=0.1)
    scheduler = lr_scheduler.StepLR(optimizer, 1, 0.5)
    optimizer.add_param_group({"params": [added], "lr": 0.01})  # after the scheduler: no initial_lr, as in plain torch
    twin = build_twin(optimizer, min_8bit_size=4096, paged=False)
    rebind_schedulers([scheduler], optimizer, twin)
    rebind_schedulers([scheduler], twin, optimizer)
    assert scheduler.optimizer is optimizer
    assert ["initial_lr" in group for group in optimizer.param_groups] == [True, False]
    assert ["initial_lr" in group for group in twin.param_groups] == [True, False]
