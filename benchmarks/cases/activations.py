"""Case ``activations``: bytes held for backward, step time and peak RSS per activation policy, on the
demo model and on a wider, longer configuration, beside hand-written torch equivalents."""

from __future__ import annotations

import functools
import time

import torch
from torch.utils.checkpoint import checkpoint

from benchmarks.harness import Case, model_groups, panels, register
from lightning_efficient.memory import SavedTensorCounter, current_rss_bytes, peak_rss_bytes, reset_peak_rss

CONFIGS = {
    "demo": ({"vocab_size": 8192, "n_layers": 4, "d_model": 256, "n_heads": 4, "seq_len": 128}, 16),
    "wide": ({"vocab_size": 8192, "n_layers": 4, "d_model": 512, "n_heads": 8, "seq_len": 512}, 8),
}
QUICK = ({"vocab_size": 512, "n_layers": 2, "d_model": 64, "n_heads": 2, "seq_len": 64}, 4)
VARIANTS = ("keep", "checkpoint", "selective", "disk", "auto_50", "torch_checkpoint", "torch_save_on_cpu")


def _setup(config: str, quick: bool):
    from lightning_efficient import DemoGPT

    settings, batch_size = QUICK if quick else CONFIGS[config]
    torch.manual_seed(0)
    model = DemoGPT(**settings, fused_loss=True)
    g = torch.Generator().manual_seed(0)
    shape = (batch_size, settings["seq_len"])
    batch = {"input_ids": torch.randint(0, settings["vocab_size"], shape, generator=g),
             "labels": torch.randint(0, settings["vocab_size"], shape, generator=g)}
    return model, batch


def _exclude(model):
    ptrs = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    return lambda t: t.untyped_storage().data_ptr() in ptrs


def measure(config: str, variant: str, quick: bool) -> dict[str, float]:
    """One forward+backward of the model under ``variant``: held bytes, step time, peak RSS."""
    from lightning_efficient.activations import DiskOffload, find_blocks, plan_blocks, wrap_block
    from lightning_efficient.activations.profile import profile_blocks

    model, batch = _setup(config, quick)
    blocks = find_blocks(model)
    exclude = _exclude(model)
    loss_fn = lambda: model.token_losses(batch)["loss"]

    def step():
        loss_fn().backward()
        model.zero_grad(set_to_none=False)

    # exact per-policy figures from the profiler (what each policy really holds), every block kept
    holder = {}

    def profiled_step():
        with SavedTensorCounter(exclude=[*model.parameters(), *model.buffers()]) as counter:
            loss = loss_fn()
        holder["total"] = counter.bytes
        loss.backward()

    profiles = profile_blocks(profiled_step, loss_fn, blocks, exclude, torch.device("cpu"), min_offload_bytes=2**16,
                              policies=("keep", "selective", "checkpoint", "disk"))
    model.zero_grad(set_to_none=False)
    fixed = holder["total"]  # the profiler's per-block hooks shadow the outer count inside blocks
    keep_total = fixed + sum(p.held_bytes["keep"] for p in profiles)
    disk = None
    if variant == "auto_50":
        plan = plan_blocks(profiles, keep_total // 2, fixed, ("keep", "selective", "checkpoint", "disk"))
        policies = plan.policies
    elif variant in ("keep", "checkpoint", "selective", "disk"):
        policies = [variant] * len(blocks)
    else:
        policies = ["keep"] * len(blocks)
    if "disk" in policies:
        disk = DiskOffload(None, 2**16, exclude)
    for index, ((_, block), p) in enumerate(zip(blocks, policies)):
        wrap_block(block, p, hooks=(lambda i=index: disk.hooks(i)) if p == "disk" else None)
    if variant == "torch_checkpoint":
        for _, block in blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    context = torch.autograd.graph.save_on_cpu if variant == "torch_save_on_cpu" else None

    def run():
        if context is None:
            step()
        else:
            with context(pin_memory=False):
                loss = loss_fn()
            loss.backward()
            model.zero_grad(set_to_none=False)

    run()  # warm-up
    with SavedTensorCounter(exclude=[*model.parameters(), *model.buffers()]) as outer:
        loss = loss_fn() if context is None else None
    if loss is not None:
        loss.backward()
        model.zero_grad(set_to_none=False)
    before = current_rss_bytes()
    reset_peak_rss()
    run()
    rss = peak_rss_bytes() - before
    repeats = 1 if quick else 3
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    seconds = (time.perf_counter() - start) / repeats
    held_policy = {"torch_checkpoint": "checkpoint", "torch_save_on_cpu": "keep"}.get(variant)
    per_block = [p.held_bytes[held_policy or pol] for p, pol in zip(profiles, policies)]
    figures = {
        "held_bytes": fixed + sum(per_block),
        "outer_hooks_bytes": outer.bytes,
        "peak_rss_above_start_bytes": rss,
        "step_time_s": seconds,
    }
    if variant == "auto_50":
        figures["budget_bytes"] = keep_total // 2
    if disk is not None:
        figures["disk_written_bytes_per_step"] = disk.bytes_written / (repeats + 3)
        disk.close()
    return figures


def chart(case: Case, results: dict, path) -> None:
    """Per model, each policy as a point: bytes held for backward against step time, both as ratios
    to that model's ``keep`` — the trade the planner chooses along."""
    groups = model_groups(results)
    plt, fig, axes = panels(len(groups))
    for ax, (model, variants) in zip(axes, groups.items()):
        keep = variants.get("keep", {})
        for index, (variant, figures) in enumerate(variants.items()):
            if "error" in figures or not keep:
                continue
            x = figures["step_time_s"] / keep["step_time_s"]
            y = figures["held_bytes"] / keep["held_bytes"]
            ax.scatter([x], [y], s=60, marker="os^Dv<>p"[index % 8], color=plt.get_cmap("tab10")(index % 10), label=variant)
        ax.legend(fontsize=7)
        ax.set_xlabel("step time / keep")
        ax.set_ylabel("bytes held for backward / keep")
        ax.set_ylim(bottom=0)
        ax.axhline(1.0, color="grey", linewidth=0.6)
        ax.axvline(1.0, color="grey", linewidth=0.6)
        ax.set_title(f"activations: {model}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


register(
    Case(
        name="activations",
        description=(
            "One forward+backward of the demo GPT (4 layers, d_model 256, seq 128, batch 16) and of a wider, "
            "longer one (d_model 512, seq 512, batch 8), fused loss, per activation policy. `held_bytes` "
            "is what each policy really holds for backward (profiled per block: saved storages for keep, "
            "block inputs for checkpoint, inputs + saved matmul/attention outputs for selective, tensors "
            "under 64 KiB for disk); `outer_hooks_bytes` is what an outer saved_tensors_hooks count sees; "
            "peak RSS is above the RSS before the step."
        ),
        baseline="demo/keep",
        variants={f"{c}/{v}": functools.partial(measure, c, v) for c in CONFIGS for v in VARIANTS},
        timeout_s=1200.0,
        chart=chart,
    )
)
