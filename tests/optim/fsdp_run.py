"""Run by test_fsdp.py: EightBitOptimizer under FSDP2 (ModelParallelStrategy, 2 gloo processes on CPU).

``python fsdp_run.py MODE OUT [ARGS]``; every rank writes ``OUT.rank{r}.pt`` with what the test checks.

- ``steps``: 4 steps; each step's local update checked against bitsandbytes run on the same local
  tensor, gradient and state alone; state bytes per rank.
- ``resume KIND``: 4 steps straight, and 2 + 2 resumed from a checkpoint (KIND ``distributed`` or ``full``).
- ``convert KIND``: 2 steps of plain 32-bit AdamW, then 2 more resumed with EightBitOptimizer; and 2 steps
  8-bit, then 2 more resumed with EightBitOptimizer(bits=32).
- ``refuse``: offload="cpu" with sharded parameters; a checkpoint from another layout.
"""

import copy
import sys
from pathlib import Path

import lightning
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_efficient import DemoGPT, EightBitOptimizer

KWARGS = {"vocab_size": 512, "n_layers": 2, "d_model": 45, "n_heads": 3, "seq_len": 33}
MIN_8BIT = 1000  # qkv, mlp and proj 8-bit; 45 columns: uneven shards (proj 23/22 rows: 5 and 4 blocks) whose blocks do not line up with one-device ones


class Rows(torch.utils.data.Dataset):
    """8 rows: 2 steps an epoch on 2 ranks, so the step-2 checkpoint is at an epoch end."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(0, 512, (32,), generator=g), "labels": torch.randint(0, 512, (32,), generator=g)}


class Sharded(DemoGPT):
    """The demo GPT, ``fully_shard`` per block and on the root (Lightning's FSDP2 recipe)."""

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def train_dataloader(self):
        return DataLoader(Rows(), batch_size=2)


def trainer(steps, callbacks, ckpt_dir=None, distributed=True):
    extra = {}
    if ckpt_dir is not None:
        callbacks = [*callbacks, ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1, filename="{step}")]
    return lightning.Trainer(
        accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                                                      save_distributed_checkpoint=distributed),
        max_steps=steps, logger=False, enable_checkpointing=ckpt_dir is not None, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, callbacks=list(callbacks), **extra,
    )


def model():
    lightning.seed_everything(0)
    return Sharded(**KWARGS, warmup_steps=0, learning_rate=1e-2)


def local_states(optimizer):
    names = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    return {names[id(p)]: {k: (v.to_local() if isinstance(v, DTensor) else v).clone() if isinstance(v, torch.Tensor) else v
                           for k, v in s.items()} for p, s in optimizer.state.items()}


def local_params(module):
    return {n: p.to_local().detach().clone() for n, p in module.named_parameters()}


def full_params(module):
    return {n: p.full_tensor().detach().clone() for n, p in module.named_parameters()}


class CheckLocalUpdates(lightning.Callback):
    """Each step: the update of every local shard equals bitsandbytes run on that local tensor alone."""

    def __init__(self):
        self.checked, self.mismatches, self.eight_bit = 0, [], 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.before = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                hyper = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay")}
                state = copy.deepcopy(dict(optimizer.state[p])) if p in optimizer.state else None
                self.before.append((p, p.to_local().detach().clone(), p.grad.to_local().detach().clone(), state, hyper))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        import bitsandbytes as bnb

        optimizer = trainer.optimizers[0]
        for p, local, grad, state, hyper in self.before:
            after = optimizer.state[p]
            eight = after["state1"].dtype == torch.uint8
            self.eight_bit += eight and batch_idx == 0
            ref = local.clone()
            ref.grad = grad
            alone = bnb.optim.AdamW8bit([ref], **hyper, min_8bit_size=0 if eight else 10**12)
            if state is not None:
                alone.state[ref] = state
            alone.step()
            ok = torch.equal(ref, p.to_local().detach()) and all(
                torch.equal(alone.state[ref][k], after[k]) for k in after if isinstance(after[k], torch.Tensor))
            assert after["state1"].shape == p.to_local().shape
            if not ok:
                self.mismatches.append((batch_idx, tuple(p.shape)))
            self.checked += 1


def save(out, payload):
    torch.save(payload, f"{out}.rank{torch.distributed.get_rank()}.pt")


def mode_steps(out):
    from lightning_efficient.memory import optimizer_state_bytes

    check = CheckLocalUpdates()
    callback = EightBitOptimizer(min_8bit_size=MIN_8BIT)
    t = trainer(4, [callback, check])
    module = model()
    t.fit(module)
    optimizer = t.optimizers[0]
    by_kind = {"8bit_numel": 0, "8bit_bytes": 0, "32bit_numel": 0, "32bit_bytes": 0}
    qmaps = {}
    for p, s in optimizer.state.items():
        local = p.to_local()
        kind = "8bit" if s["state1"].dtype == torch.uint8 else "32bit"
        by_kind[f"{kind}_numel"] += local.numel()
        by_kind[f"{kind}_bytes"] += sum(s[k].numel() * s[k].element_size() for k in ("state1", "state2", "absmax1", "absmax2") if k in s)
        qmaps.update({s[k].data_ptr(): s[k].numel() * s[k].element_size() for k in ("qmap1", "qmap2") if k in s})
    save(out, {
        "type": type(optimizer).__name__, "checked": check.checked, "mismatches": check.mismatches, "eight_bit": check.eight_bit,
        "state_bytes": optimizer_state_bytes(optimizer), "qmap_bytes": sum(qmaps.values()), **by_kind,
        "local_numel": sum(p.to_local().numel() for p in module.parameters()),
        "global_numel": sum(p.numel() for p in module.parameters()),
        "all_dtensor": all(isinstance(p, DTensor) for p in module.parameters()),
        "params": full_params(module), "loss": float(t.callback_metrics.get("train_loss", float("nan"))),
    })


def mode_resume(out, kind):
    distributed = kind == "distributed"
    ckpt = Path(f"{out}.ckpt-{kind}")
    straight = model()
    t = trainer(4, [EightBitOptimizer(min_8bit_size=MIN_8BIT)], ckpt_dir=ckpt, distributed=distributed)
    t.fit(straight)
    first = local_states(t.optimizers[0])
    resumed = model()
    t2 = trainer(4, [EightBitOptimizer(min_8bit_size=MIN_8BIT)], distributed=distributed)
    t2.fit(resumed, ckpt_path=str(ckpt / "step=2.ckpt"))
    second = local_states(t2.optimizers[0])
    save(out, {"straight": full_params(straight), "resumed": full_params(resumed), "states": (first, second),
               "is_dir": (ckpt / "step=2.ckpt").is_dir()})


def mode_convert(out, kind):
    """32-bit AdamW -> 8-bit and 8-bit -> 32-bit, each resumed from a step-2 checkpoint."""
    from lightning_efficient.optim.state import dequantize_adam_state, quantize_adam_state

    distributed = kind == "distributed"
    results = {}
    for source_bits, target_bits in ((32, 8), (8, 32)):
        ckpt = Path(f"{out}.ckpt-{kind}-{source_bits}")
        source_callbacks = [] if source_bits == 32 else [EightBitOptimizer(min_8bit_size=MIN_8BIT)]
        saving = trainer(2, source_callbacks, ckpt_dir=ckpt, distributed=distributed)
        saving.fit(model())
        saved = local_states(saving.optimizers[0])

        class Loaded(lightning.Callback):
            def on_train_start(self, trainer, pl_module):  # after the checkpoint's optimizer state is loaded
                self.loaded = local_states(trainer.optimizers[0])

        loaded = Loaded()
        resumed = model()
        t = trainer(3, [EightBitOptimizer(min_8bit_size=MIN_8BIT, bits=target_bits), loaded], distributed=distributed)
        t.fit(resumed, ckpt_path=str(ckpt / "step=2.ckpt"))
        # what each local shard must hold: the saved local state converted on its own
        mismatches = []
        for index, state in saved.items():
            got = loaded.loaded[index]
            if target_bits == 8:
                eight = got["state1"].dtype == torch.uint8
                want = quantize_adam_state(state, eight)
                keys = [k for k in ("state1", "state2", "absmax1", "absmax2") if k in want]
            else:
                want = dequantize_adam_state({k: v for k, v in state.items()}) if "state1" in state else state
                keys = ["exp_avg", "exp_avg_sq"]
            if not all(torch.equal(want[k], got[k]) for k in keys) or int(want["step"]) != int(got["step"]):
                mismatches.append(index)
        results[f"{source_bits}->{target_bits}"] = {"mismatches": mismatches, "count": len(saved),
                                                    "type": type(t.optimizers[0]).__name__,
                                                    "finite": all(torch.isfinite(p).all() for p in full_params(resumed).values())}
    save(out, results)


def mode_refuse(out):
    errors = {}
    try:
        trainer(1, [EightBitOptimizer(offload="cpu")]).fit(model())
    except ValueError as error:
        errors["offload"] = str(error)
    save(out, errors)


if __name__ == "__main__":
    mode, out, *rest = sys.argv[1:]
    {"steps": mode_steps, "resume": mode_resume, "convert": mode_convert, "refuse": mode_refuse}[mode](out, *rest)
