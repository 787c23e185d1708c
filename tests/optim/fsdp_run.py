"""Run by test_fsdp.py: EightBitOptimizer under FSDP2 (ModelParallelStrategy, 2 gloo processes on CPU).

``python fsdp_run.py OUT UNSHARDED_CKPT``; every rank writes ``OUT.rank{r}.pt`` with what the test checks:

- 4 steps, each step's local update checked against bitsandbytes run on the same local tensor,
  gradient and state alone; the state bytes per rank;
- resumed at step 2 from Lightning's distributed checkpoint and from a full-state one, to step 4;
- 32-bit AdamW checkpoints (both kinds) resumed 8-bit, and the 8-bit ones resumed with ``bits=32``;
- refusals: ``offload="cpu"``, and ``UNSHARDED_CKPT`` (8-bit states saved on one device);
- tensor parallelism (data_parallel_size=1, tensor_parallel_size=2): local updates and a resume.
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
            self.eight_bit += eight and trainer.global_step == 1
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


class Snapshot(lightning.Callback):
    """Local optimizer states when training starts (after a checkpoint's states are loaded) and after step 2."""

    def on_train_start(self, trainer, pl_module):
        self.loaded = local_states(trainer.optimizers[0])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 2:
            self.step2 = local_states(trainer.optimizers[0])
            trainer.should_stop = trainer.should_stop or self.stop_at_2

    def __init__(self, stop_at_2=False):
        self.stop_at_2 = stop_at_2


def state_bytes(optimizer, module):
    """Bytes of the 8-bit and the 32-bit states, and their local parameter counts."""
    from lightning_efficient.memory import optimizer_state_bytes

    figures = {"8bit_numel": 0, "8bit_bytes": 0, "32bit_numel": 0, "32bit_bytes": 0}
    qmaps = {}
    for p, s in optimizer.state.items():
        kind = "8bit" if s["state1"].dtype == torch.uint8 else "32bit"
        figures[f"{kind}_numel"] += p.to_local().numel()
        figures[f"{kind}_bytes"] += sum(s[k].numel() * s[k].element_size() for k in ("state1", "state2", "absmax1", "absmax2") if k in s)
        qmaps.update({s[k].data_ptr(): s[k].numel() * s[k].element_size() for k in ("qmap1", "qmap2") if k in s})
    return {**figures, "qmap_bytes": sum(qmaps.values()), "state_bytes": optimizer_state_bytes(optimizer),
            "local_numel": sum(p.to_local().numel() for p in module.parameters()),
            "global_numel": sum(p.numel() for p in module.parameters()),
            "all_dtensor": all(isinstance(p, DTensor) for p in module.parameters())}


def converted_mismatches(saved, loaded, target_bits):
    """Parameters whose loaded local state is not the saved local state converted on its own."""
    from lightning_efficient.optim.state import dequantize_adam_state, quantize_adam_state

    bad = []
    for index, state in saved.items():
        got = loaded[index]
        if target_bits == 8:
            want = quantize_adam_state(state, got["state1"].dtype == torch.uint8)
            keys = [k for k in ("state1", "state2", "absmax1", "absmax2") if k in want]
        else:
            want = dequantize_adam_state(state) if "state1" in state else state
            keys = ["exp_avg", "exp_avg_sq"]
        if not all(torch.equal(want[k], got[k]) for k in keys) or int(want["step"]) != int(got["step"]):
            bad.append(index)
    return bad


def main(out, unsharded_ckpt):
    eight = lambda **kw: EightBitOptimizer(min_8bit_size=MIN_8BIT, **kw)
    results = {}
    # A: 4 steps straight, every local update checked, a distributed checkpoint at step 2
    check, at_a, at_b = CheckLocalUpdates(), Snapshot(), Snapshot(stop_at_2=True)
    straight = model()
    t = trainer(4, [eight(), check, at_a], ckpt_dir=f"{out}.A")
    t.fit(straight)
    results["steps"] = {"type": type(t.optimizers[0]).__name__, "checked": check.checked, "mismatches": check.mismatches,
                        "eight_bit": check.eight_bit, **state_bytes(t.optimizers[0], straight)}
    results["straight"] = full_params(straight)
    straight_states = local_states(t.optimizers[0])
    a_ckpt = f"{out}.A/step=2.ckpt"
    # B: the same first 2 steps (of a 4-step schedule), a full-state checkpoint
    trainer(4, [eight(), at_b], ckpt_dir=f"{out}.B", distributed=False).fit(model())
    b_ckpt = f"{out}.B/step=2.ckpt"
    # resumed from either to step 4
    for kind, path, distributed in (("distributed", a_ckpt, True), ("full", b_ckpt, False)):
        resumed = model()
        t = trainer(4, [eight()], distributed=distributed)
        t.fit(resumed, ckpt_path=path)
        results[f"resume_{kind}"] = {"params": full_params(resumed), "states": local_states(t.optimizers[0]),
                                     "is_dir": Path(path).is_dir()}
    results["straight_states"] = straight_states
    # 32-bit AdamW checkpoints (E: distributed, H: full) resumed 8-bit; the 8-bit ones (A, B) resumed with bits=32
    for kind, distributed in (("distributed", True), ("full", False)):
        saving = trainer(2, [], ckpt_dir=f"{out}.{kind}-32", distributed=distributed)
        saving.fit(model())
        saved32 = local_states(saving.optimizers[0])
        saved8, path8 = (at_a.step2, a_ckpt) if distributed else (at_b.step2, b_ckpt)
        for target_bits, path, source in ((8, f"{out}.{kind}-32/step=2.ckpt", saved32), (32, path8, saved8)):
            snapshot = Snapshot()
            resumed = model()
            t = trainer(3, [EightBitOptimizer(min_8bit_size=MIN_8BIT, bits=target_bits), snapshot], distributed=distributed)
            t.fit(resumed, ckpt_path=path)
            results[f"convert_{kind}_to_{target_bits}"] = {
                "mismatches": converted_mismatches(source, snapshot.loaded, target_bits), "count": len(source),
                "type": type(t.optimizers[0]).__name__,
                "finite": all(bool(torch.isfinite(p).all()) for p in full_params(resumed).values()),
            }
    # refusals before the first step
    errors = {}
    for name, callbacks, path in (("offload", [EightBitOptimizer(offload="cpu")], None),
                                  ("unsharded_checkpoint", [eight()], unsharded_ckpt)):
        try:
            trainer(1, callbacks).fit(model(), ckpt_path=path)
        except ValueError as error:
            errors[name] = str(error)
    results["errors"] = errors
    results["tensor_parallel"] = tensor_parallel(out)
    save(out, results)




class TensorParallel(lightning.LightningModule):
    """An MLP split by tensor parallelism: ``up`` column-wise (Shard(0)), ``down`` row-wise (Shard(1), bias replicated)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(32, 256), torch.nn.Linear(256, 32)

    def configure_model(self):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(self, self.device_mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})

    def training_step(self, batch, batch_idx):
        x = batch["input_ids"].float() / 512
        return torch.nn.functional.mse_loss(self.down(torch.nn.functional.gelu(self.up(x))), x)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    def train_dataloader(self):  # every rank sees every row (dp=1): 4 rows, 2 steps an epoch
        return DataLoader(torch.utils.data.Subset(Rows(), range(4)), batch_size=2)


def tensor_parallel(out):
    """dp=1, tp=2: every local update checked; a distributed checkpoint at step 2 resumed exactly."""
    def tp_trainer(callbacks, ckpt_dir=None):
        extra = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1, filename="{step}")] if ckpt_dir else []
        return lightning.Trainer(
            accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
            max_steps=4, logger=False, enable_checkpointing=bool(ckpt_dir), enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=0, callbacks=[*callbacks, *extra])

    check = CheckLocalUpdates()
    lightning.seed_everything(0)
    straight = TensorParallel()
    t = tp_trainer([EightBitOptimizer(min_8bit_size=1000), check], ckpt_dir=f"{out}.TP")
    t.fit(straight)
    lightning.seed_everything(0)
    resumed = TensorParallel()
    t2 = tp_trainer([EightBitOptimizer(min_8bit_size=1000)])
    t2.fit(resumed, ckpt_path=f"{out}.TP/step=2.ckpt")
    a, b = full_params(straight), full_params(resumed)
    placements = {n: str(p.placements) for n, p in straight.named_parameters()}
    return {"checked": check.checked, "mismatches": check.mismatches, "eight_bit": check.eight_bit,
            "placements": placements, "resume_exact": all(torch.equal(a[k], b[k]) for k in a),
            "type": type(t.optimizers[0]).__name__}


if __name__ == "__main__":
    main(*sys.argv[1:])
