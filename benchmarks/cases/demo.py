"""Case ``demo``: the demo model with no plugins, the baseline later cases compare to."""

from __future__ import annotations

from benchmarks.common import measured_fit
from benchmarks.harness import Case, register


def baseline(quick: bool) -> dict[str, float]:
    """The demo GPT (4 layers, d_model 256, seq 128, batch 16, vocab 8192) with no plugin."""
    from lightning_efficient import CorpusDataModule, DemoGPT

    data = CorpusDataModule(max_files=60 if quick else None, batch_size=4 if quick else 16)
    model = DemoGPT(n_layers=2 if quick else 4)
    return measured_fit(model, data, steps=4 if quick else 30)


register(
    Case(
        name="demo",
        description="The demo GPT trained with no plugin: bytes and time per step (CPU, 2 cores).",
        baseline="baseline",
        variants={"baseline": baseline},
    )
)
