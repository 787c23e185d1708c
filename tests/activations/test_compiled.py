"""ActivationMemory on blocks the user compiled (``block.compile()``): the blocks stay compiled, one graph each with no
graph break, the compiled graph runs at every step (also after ``policy="auto"`` profiled them), and the fit equals the
same compiled fit in plain Lightning."""

from __future__ import annotations

import itertools

import lightning
import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset

from lightning_efficient import ActivationMemory

STEPS = 4


class CountingBackend:
    """A torch.compile backend that runs each captured graph as it is, counting the graphs made and their runs."""

    def __init__(self) -> None:
        self.graphs = 0
        self.runs = 0
        self.traced_files: set[str] = set()  # the source files of the graphs' operations

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs += 1
        self.traced_files |= {line.split('"')[1] for node in graph.graph.nodes
                              for line in (node.meta.get("stack_trace") or "").splitlines() if line.strip().startswith("File")}

        def run(*args: object) -> object:
            self.runs += 1
            return graph.forward(*args)

        return run


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class CompiledBlocks(lightning.LightningModule):
    """Blocks compiled in place in ``configure_model``, as users of torch.compile write it."""

    def __init__(self, backend: CountingBackend) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(32) for _ in range(2))
        self.head = nn.Linear(32, 1)
        self.backend = backend
        self.runs_at_step_end: list[int] = []

    def configure_model(self) -> None:
        for block in self.blocks:
            block.compile(backend=self.backend)

    def training_step(self, batch, batch_idx):
        x, y = batch
        for block in self.blocks:
            x = block(x)
        return nn.functional.mse_loss(self.head(x).squeeze(-1), y)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.runs_at_step_end.append(self.backend.runs)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randn(16, 8, 32, generator=g), torch.randn(16, 8, generator=g)), batch_size=4)


def _fit(callbacks: list, module_class: type[CompiledBlocks] = CompiledBlocks) -> tuple[CompiledBlocks, dict]:
    torch._dynamo.reset()
    counters.clear()
    module = module_class(CountingBackend())
    lightning.Trainer(accelerator="cpu", max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=callbacks).fit(module)
    return module, {"graph_breaks": dict(counters["graph_break"]), "graphs": module.backend.graphs,
                    "frames": counters["frames"]["total"]}


class FrozenNormBlocks(CompiledBlocks):
    """Each block with a BatchNorm in eval mode (frozen for fine-tuning: it updates no running statistics)."""

    def __init__(self, backend: CountingBackend) -> None:
        super().__init__(backend)
        for block in self.blocks:
            block.norm = nn.BatchNorm1d(8).eval()

    def on_train_epoch_start(self) -> None:
        for block in self.blocks:
            block.norm.eval()


@pytest.mark.parametrize("policy", ["checkpoint", "selective", "auto", "checkpoint-frozen-batchnorm"])
def test_compiled_blocks_stay_compiled_and_train_as_the_compiled_fit_in_plain_lightning(policy):
    # a new user's trial: the checkpointed forward counted its runs in a closure (for BatchNorm's running statistics), a
    # side effect torch.compile refuses inside a checkpoint: every block ran eagerly, silently; and policy="auto" timed
    # the blocks under a dispatch mode, after which torch never ran them compiled again in the process
    module_class = FrozenNormBlocks if policy.endswith("frozen-batchnorm") else CompiledBlocks
    plain, plain_compiled = _fit([], module_class)
    kwargs = {"budget": 0.5} if policy == "auto" else {}
    ours, compiled = _fit([ActivationMemory(policy=policy.split("-")[0], **kwargs)], module_class)
    assert compiled["graph_breaks"] == plain_compiled["graph_breaks"] == {}
    assert compiled["graphs"] == plain_compiled["graphs"] > 0
    # each step runs both blocks' compiled graphs (the compiled backward runs through the same graph's autograd)
    runs = ours.runs_at_step_end
    assert all(later > earlier for earlier, later in itertools.pairwise(runs)), runs
    assert runs[-1] - runs[0] == plain.runs_at_step_end[-1] - plain.runs_at_step_end[0]
    for (name, a), b in zip(ours.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


class BreakInALoop(CompiledBlocks):
    """The whole forward compiled, with a graph break inside the loop over the blocks (a ``print`` or a data-dependent
    branch there): torch runs the frame eagerly, its compile callback still on while the step's hooks run."""

    def configure_model(self) -> None:
        pass

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(torch.compile(self.body, backend=self.backend)(batch[0]).squeeze(-1), batch[1])

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
            torch._dynamo.graph_break()
        return self.head(x)


def test_memory_reports_saved_tensor_hooks_are_never_compiled():
    # a new user's trial: dynamo compiled MemoryReport's hooks, called from a compiled function's eager parts, once per
    # tensor shape up to its recompile limit ("hit config.recompile_limit (8)", memory.py's _pack). (The disk policy's
    # wrapped forward is traced, as it must be for a compiled block to stay compiled: its hooks graph-break there.)
    from lightning_efficient import MemoryReport

    def frames_compiled(callbacks: list) -> int:
        return _fit(callbacks, BreakInALoop)[1]["frames"]

    plain = frames_compiled([])
    assert plain > 0  # the user's own frames
    assert frames_compiled([MemoryReport(every_n_steps=1, print_table=False)]) == plain


class RotaryBlock(nn.Module):
    """Makes its rotary frequencies in the default dtype (``torch.arange(...) / d``), as many attention blocks do."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, length, width = x.shape
        angles = torch.arange(length)[:, None] * (1.0 / 10000 ** (torch.arange(0, width, 2) / width))[None, :]
        cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
        q, k, v = self.qkv(x).split(width, -1)

        def rotated(z: torch.Tensor) -> torch.Tensor:
            return z * cos + torch.cat([-z[..., width // 2:], z[..., : width // 2]], -1) * sin

        attended = nn.functional.scaled_dot_product_attention(rotated(q)[:, None], rotated(k)[:, None], v[:, None], is_causal=True)
        return x + self.proj(attended[:, 0])


class RotaryModel(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(RotaryBlock(32) for _ in range(2))

    def training_step(self, batch, batch_idx):
        x = batch[0]
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("precision", ["64-true", "bf16-true"])
@pytest.mark.parametrize("policy", ["checkpoint", "selective"])
def test_a_block_making_tensors_of_the_default_dtype_recomputes_under_the_precisions_default_dtype(policy, precision):
    # a new user's trial: Lightning sets bf16-true's and 64-true's default dtype around the forward only, so the
    # recomputation in backward made the block's rotary frequencies in float32: a dtype mismatch in attention (bf16-true)
    # or torch's "Recomputed values ... have different metadata" (64-true)
    def fit(callbacks):
        module = RotaryModel()
        data = DataLoader(TensorDataset(torch.randn(8, 16, 32, generator=torch.Generator().manual_seed(1))), batch_size=4)
        lightning.Trainer(accelerator="cpu", max_epochs=1, precision=precision, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks).fit(module, data)
        return module

    ours, plain = fit([ActivationMemory(policy=policy)]), fit([])
    assert torch.get_default_dtype() == torch.float32
    for a, b in zip(ours.parameters(), plain.parameters()):
        assert torch.equal(a, b)
