"""Every GPU measurement in one go: ``python benchmarks/gpu_check.py`` (about 3 minutes on an H100).

Prints one table: check, variant, metric, value, ratio to the check's baseline. With no CUDA device
it says so and exits 0; ``--smoke`` runs every check at toy sizes on the CPU (what the tests do, to
keep this script working where no GPU is at hand).

Checks, on a GPT of about 110 M parameters (12 layers, d_model 768, seq 1024, vocab 32,768, batch 8,
bf16 autocast, torch fused AdamW) unless said otherwise:
  * ``baseline``: peak ``max_memory_allocated`` and step time, no plugin;
  * ``tokens``: fused linear cross-entropy with top-k selection at keep 0.5 (no full logits);
  * ``activations``: every block checkpointed, selective, and offloaded to pinned host memory on a
    side stream (bytes moved off the device, step time);
  * ``optim``: optimizer step time and state bytes: torch fused AdamW, bitsandbytes AdamW8bit used
    directly, our conversion, and our conversion with host-offloaded states;
  * ``linear_ce``: the loss path alone at vocabulary 32,000, hidden 2,048, 16,384 tokens;
  * ``probe``: ``hetero_ddp``'s ``max_micro_batch="auto"`` in a real Lightning fit with the CUDA
    allocator limited to the model's footprint plus 24 GiB: the probed cap, the accumulation it
    implies and the training peak against the limit.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

Row = tuple[str, str, str, float, float | None]
SIZES = {
    "gpu": {"model": {"vocab_size": 32768, "n_layers": 12, "d_model": 768, "n_heads": 12, "seq_len": 1024}, "batch": 8,
            "ce": (16384, 2048, 32000), "steps": 10, "probe": (256, 24 * 2**30)},
    "smoke": {"model": {"vocab_size": 512, "n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 32}, "batch": 2,
              "ce": (256, 32, 512), "steps": 1, "probe": (8, None)},
}


class Bench:
    """Device, sizes and the measuring helpers shared by the checks."""

    def __init__(self, device: torch.device, sizes: dict) -> None:
        self.device, self.sizes = device, sizes
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else 0

    def timed(self, step: Callable[[], None]) -> tuple[float, int]:
        """Mean seconds per step after a warm-up step, and the peak bytes allocated over those steps."""
        step()
        self.sync()
        self.reset_peak()
        start = time.perf_counter()
        for _ in range(self.sizes["steps"]):
            step()
        self.sync()
        return (time.perf_counter() - start) / self.sizes["steps"], self.peak()

    def model(self, **extra):
        from lightning_efficient import DemoGPT

        torch.manual_seed(0)
        return DemoGPT(**self.sizes["model"], **extra).to(self.device)

    def batch(self) -> dict[str, torch.Tensor]:
        vocab, seq = self.sizes["model"]["vocab_size"], self.sizes["model"]["seq_len"]
        shape = (self.sizes["batch"], seq)
        return {"input_ids": torch.randint(0, vocab, shape, device=self.device),
                "labels": torch.randint(0, vocab, shape, device=self.device)}

    def train_step(self, model, optimizer, loss_fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def step() -> None:
            with self.autocast:
                loss = loss_fn()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    def fused_adamw(self, model):
        fused = self.device.type == "cuda"
        return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)


def check_end_to_end(b: Bench) -> list[Row]:
    """Peak memory and step time of the GPT with and without each plugin."""
    from lightning_efficient.activations import HostOffload, find_blocks, wrap_block
    from lightning_efficient.optim.twins import build_twin
    from lightning_efficient.tokens import select_tokens
    from lightning_efficient.tokens.normalize import globally_normalised_loss

    rows: list[Row] = []
    batch = b.batch()

    def run(label: str, model, optimizer, loss_fn) -> tuple[float, int]:
        seconds, peak = b.timed(b.train_step(model, optimizer, loss_fn))
        rows.append(("end_to_end", label, "step_time_s", seconds, None))
        rows.append(("end_to_end", label, "peak_bytes", peak, None))
        return seconds, peak

    model = b.model()
    run("baseline", model, b.fused_adamw(model), lambda: model.token_losses(batch)["loss"])

    fused = b.model(fused_loss=True)

    def selected_loss(fused=fused):
        out = fused.token_losses(batch)
        losses = out.token_losses()
        keep = select_tokens("topk", losses, out.mask, 0.5).keep
        return globally_normalised_loss(losses, keep)

    run("tokens_topk_0.5_fused", fused, b.fused_adamw(fused), selected_loss)
    del fused, selected_loss  # the model is freed before the next case

    for policy in ("checkpoint", "selective", "offload"):
        m = b.model()
        ptrs = {p.untyped_storage().data_ptr() for p in m.parameters()}
        host = HostOffload(min_bytes=2**20, use_streams=True, exclude=lambda t, ptrs=ptrs: t.untyped_storage().data_ptr() in ptrs)
        for index, (_, block) in enumerate(find_blocks(m)):
            hooks = (lambda i=index, host=host: host.hooks(i)) if policy == "offload" else None
            wrap_block(block, policy if policy != "offload" or b.device.type == "cuda" else "keep", hooks=hooks)
        run(f"activations_{policy}", m, b.fused_adamw(m), lambda m=m: m.token_losses(batch)["loss"])
        if policy == "offload":
            rows.append(("end_to_end", "activations_offload", "offloaded_bytes_per_step",
                         host.bytes_offloaded / (b.sizes["steps"] + 1), None))
        del m

    m = b.model()
    optimizer = build_twin(torch.optim.AdamW(m.parameters(), lr=1e-4), min_8bit_size=4096, paged=False)
    run("optim_8bit", m, optimizer, lambda: m.token_losses(batch)["loss"])
    return _with_ratios(rows, "baseline")


def check_optimizer_step(b: Bench) -> list[Row]:
    """Optimizer step time and state bytes alone, random gradients."""
    import bitsandbytes as bnb

    from lightning_efficient.memory import optimizer_state_bytes
    from lightning_efficient.optim.offload import host_offloaded
    from lightning_efficient.optim.twins import build_twin

    rows: list[Row] = []
    model = b.model()
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    builders = {
        "torch_fused_adamw": lambda: b.fused_adamw(model),
        "bnb_adamw8bit": lambda: bnb.optim.AdamW8bit(params, lr=1e-4, weight_decay=0.01),
        "ours_8bit": lambda: build_twin(torch.optim.AdamW(params, lr=1e-4), min_8bit_size=4096, paged=False),
        "ours_8bit_host_offload": lambda: host_offloaded(bnb.optim.AdamW8bit)(params, lr=1e-4, weight_decay=0.01),
    }
    for label, build in builders.items():
        optimizer = build()
        seconds, _ = b.timed(optimizer.step)
        rows.append(("optim_step", label, "step_time_s", seconds, None))
        rows.append(("optim_step", label, "state_bytes_per_param",
                     optimizer_state_bytes(optimizer) / sum(p.numel() for p in params), None))
        del optimizer
    return _with_ratios(rows, "torch_fused_adamw")


def check_linear_ce(b: Bench) -> list[Row]:
    """The loss path alone: full logits + cross-entropy against the chunked linear cross-entropy."""
    from lightning_efficient.tokens import linear_cross_entropy

    n, d, v = b.sizes["ce"]
    dtype = torch.bfloat16 if b.device.type == "cuda" else torch.float32
    hidden = torch.randn(n, d, device=b.device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(v, d, device=b.device, dtype=dtype) * 0.02).requires_grad_()
    labels = torch.randint(0, v, (n,), device=b.device)
    rows: list[Row] = []
    variants = {
        "full_logits": lambda: F.cross_entropy((hidden @ weight.t()).float(), labels),
        "chunked_mean": lambda: linear_cross_entropy(hidden, weight, labels, reduction="mean"),
        "chunked_per_token_keep_0.5": lambda: linear_cross_entropy(hidden, weight, labels)[::2].mean(),
    }
    for label, loss_fn in variants.items():
        def step(loss_fn=loss_fn):
            loss_fn().backward()
            hidden.grad = weight.grad = None

        seconds, peak = b.timed(step)
        rows += [("linear_ce", label, "fwd_bwd_time_s", seconds, None), ("linear_ce", label, "peak_bytes", peak, None)]
    return _with_ratios(rows, "full_logits")


def check_probe(b: Bench) -> list[Row]:
    """``max_micro_batch="auto"`` in a one-process ``hetero_ddp`` fit under a CUDA allocator limit."""
    import lightning

    from lightning_efficient import HeterogeneousDDPStrategy

    global_batch, headroom = b.sizes["probe"]
    model = b.model()
    samples = [{k: v[0].cpu() for k, v in b.batch().items()} for _ in range(2 * global_batch)]
    on_cuda = b.device.type == "cuda"
    limit = None
    if on_cuda and headroom:
        limit = torch.cuda.memory_allocated(b.device) + headroom
        torch.cuda.set_per_process_memory_fraction(limit / torch.cuda.get_device_properties(b.device).total_memory)
    try:
        strategy = HeterogeneousDDPStrategy(global_batch_size=global_batch, max_micro_batch="auto")
        trainer = lightning.Trainer(
            accelerator=b.device.type, devices=1, strategy=strategy, precision="bf16-mixed" if on_cuda else "32-true",
            max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )
        b.reset_peak()
        start = time.perf_counter()
        trainer.fit(model, torch.utils.data.DataLoader(samples, batch_size=global_batch))
        seconds = time.perf_counter() - start
    finally:
        if on_cuda:
            torch.cuda.set_per_process_memory_fraction(1.0)
    rows: list[Row] = [
        ("probe", "auto", "max_micro_batch", float(strategy.micro_batch_caps[0]), None),
        ("probe", "auto", "accumulation", float(trainer.accumulate_grad_batches), None),
        ("probe", "auto", "fit_incl_probe_s", seconds, None),
        ("probe", "auto", "train_peak_bytes", b.peak(), None),
    ]
    if limit is not None:
        rows.append(("probe", "auto", "limit_bytes", limit, None))
    return rows


def _with_ratios(rows: list[Row], baseline: str) -> list[Row]:
    base = {(c, m): v for c, var, m, v, _ in rows if var == baseline}
    return [(c, var, m, v, v / base[(c, m)] if base.get((c, m)) else None) for c, var, m, v, _ in rows]


CHECKS: list[Callable[[Bench], list[Row]]] = [check_end_to_end, check_optimizer_step, check_linear_ce, check_probe]


def main(argv: list[str] | None = None) -> int:
    """Run every check and print the table; exit 0 without a GPU."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (checks the script itself)")
    args = parser.parse_args(argv)
    if args.smoke:
        bench = Bench(torch.device("cpu"), SIZES["smoke"])
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing measured.")
        return 0
    else:
        bench = Bench(torch.device("cuda"), SIZES["gpu"])
        print(f"gpu_check on {torch.cuda.get_device_name()} (torch {torch.__version__})")
    rows: list[Row] = []
    for check in CHECKS:
        try:
            rows += check(bench)
        except Exception as error:  # noqa: BLE001 - one failing check must not hide the others' figures
            rows.append((check.__name__, "-", f"error: {error!r}"[:100], float("nan"), None))
        if bench.device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"| {'check':<11} | {'variant':<26} | {'metric':<24} | {'value':>14} | ratio |")
    print(f"|{'-' * 13}|{'-' * 28}|{'-' * 26}|{'-' * 16}|-------|")
    for name, variant, metric, value, ratio in rows:
        if metric.endswith("bytes"):
            shown = f"{value / 2**20:,.1f} MiB"
        elif metric.endswith("_s"):
            shown = f"{value * 1e3:,.2f} ms"
        else:
            shown = f"{value:.4g}"
        print(f"| {name:<11} | {variant:<26} | {metric:<24} | {shown:>14} | {'-' if ratio is None else f'{ratio:.3f}'} |")
    return 1 if any(r[2].startswith("error") for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
