import json
from pathlib import Path

import bitsandbytes as bnb
import lightning
import pytest
import torch

from lightning_efficient import CorpusDataModule, DemoGPT, MemoryReport
from lightning_efficient.memory import current_rss_bytes
from tests.conftest import tiny_gpt_kwargs


def test_fit_reports_exact_optimizer_bytes_and_prints_the_table(small_datamodule_kwargs, tmp_path, capsys):
    lightning.seed_everything(0)
    model = DemoGPT(**tiny_gpt_kwargs())
    report = MemoryReport(every_n_steps=2, json_path=str(tmp_path / "report.json"))
    trainer = lightning.Trainer(
        accelerator="cpu",
        max_steps=4,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[report],
    )
    trainer.fit(model, datamodule=CorpusDataModule(**small_datamodule_kwargs))
    figures = report.report()
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    assert figures["parameter_bytes"] == 4 * numel
    assert figures["gradient_bytes"] == 4 * numel
    assert figures["optimizer_state_bytes"] == 8 * numel + 4 * len(params)
    assert figures["steps"] == 4
    batch, seq = small_datamodule_kwargs["batch_size"], small_datamodule_kwargs["seq_len"]
    assert figures["activation_bytes"] > 0
    # the logits and their log-softmax alone are saved: at least 2 x batch x seq x vocab floats
    assert figures["activation_bytes"] >= 2 * batch * seq * 512 * 4
    assert figures["tokens_per_s"] > 0 and figures["peak_rss_bytes"] > 0
    printed = capsys.readouterr().out
    assert "MemoryReport" in printed and "optimizer_state_bytes" in printed
    assert json.loads((tmp_path / "report.json").read_text())["optimizer_state_bytes"] == figures["optimizer_state_bytes"]


def test_a_model_of_float_features_is_reported_in_samples_not_tokens():
    """A new user's trial: Lightning's BoringModel (32 float features a sample) was reported at 32 "tokens" a sample; a
    batch without token ids has no tokens, and AutoFit's plan says samples/s for it too."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_efficient import AutoFit
    from lightning_efficient.autofit.model import plan_table

    report = MemoryReport(every_n_steps=2, print_table=False)
    fitter = AutoFit(budget="1GiB", activation_policies=["keep"], optimizer_options=["32-bit"])
    lightning.Trainer(accelerator="cpu", max_steps=4, limit_val_batches=0, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[report, fitter]).fit(BoringModel())
    figures = report.report()
    assert figures["samples_per_step"] == fitter.plan.micro_batches[0] and figures["samples_per_s"] > 0  # (a micro-batch)
    assert "tokens_per_s" not in figures and "tokens_per_step" not in figures
    assert fitter.plan.rate_of == "samples"
    assert fitter.plan.tokens_per_s == pytest.approx(fitter.plan.samples_per_step / fitter.plan.step_s)
    assert " samples/s, " in plan_table(fitter.plan)


def test_other_callbacks_add_their_figures(small_datamodule_kwargs):
    class Extra(lightning.Callback):
        def memory_figures(self):
            return {"extra_bytes": 123}

    report = MemoryReport(every_n_steps=1, print_table=False, log=False)
    trainer = lightning.Trainer(
        accelerator="cpu", max_steps=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, callbacks=[report, Extra()],
    )
    trainer.fit(DemoGPT(**tiny_gpt_kwargs()), datamodule=CorpusDataModule(**small_datamodule_kwargs))
    assert report.report()["extra_bytes"] == 123


def test_invalid_every_n_steps():
    with pytest.raises(ValueError, match="every_n_steps=0"):
        MemoryReport(every_n_steps=0)


def test_json_path_directory_is_created_at_construction(tmp_path):
    MemoryReport(json_path=str(tmp_path / "runs" / "a" / "report.json"))
    assert (tmp_path / "runs" / "a").is_dir()
    with pytest.raises(ValueError, match=r"json_path='.*' is not allowed: expected a file path, not a directory"):
        MemoryReport(json_path=str(tmp_path))
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"json_path='.*file/report.json' is not allowed: expected a path whose directory"):
        MemoryReport(json_path=str(tmp_path / "file" / "report.json"))


def test_ddp_report_counts_every_rank_and_gives_each_rank_memory(small_datamodule_kwargs, tmp_path):
    from tests.ddp import run_script

    out = tmp_path / "report.json"
    script = Path(__file__).parent / "ddp_report.py"
    done = run_script(script, small_datamodule_kwargs["data_path"], small_datamodule_kwargs["cache_dir"], out)
    figures = json.loads(out.read_text())
    # the run's throughput covers the whole global batch of 8 (2 + 6 samples), not rank 0's 2
    assert figures["samples_per_s"] * figures["step_time_s"] == pytest.approx(8.0, rel=1e-9)
    assert figures["samples_per_step"] == 8.0
    assert 6 * 32 < figures["tokens_per_step"] <= 8 * 32
    assert figures["world_size"] == 2
    for name in ("peak_rss_bytes", "rss_above_start_bytes", "activation_bytes"):
        per_rank = [figures[f"rank{rank}/{name}"] for rank in (0, 1)]
        assert min(per_rank) > 0 and figures[name] == max(per_rank)
    for rank in (0, 1):  # each rank's own fit above its own start: far under its whole process
        assert figures[f"rank{rank}/rss_above_start_bytes"] < figures[f"rank{rank}/peak_rss_bytes"] - 100 * 2**20
    # rank 1's micro-batch is three times rank 0's: so are the activations it saves, about
    assert figures["rank1/activation_bytes"] > 2 * figures["rank0/activation_bytes"]
    # every rank reports the same run figures; the table says what they are
    rank1 = json.loads(Path(f"{out}.rank1").read_text())
    assert rank1["samples_per_step"] == 8.0 and rank1["rank0/peak_rss_bytes"] == figures["rank0/peak_rss_bytes"]
    assert "2 ranks" in done.stdout and "rank1/peak_rss_bytes" in done.stdout



BIG = 384 * 2**20  # bytes allocated (and freed) before the first training step


class _AllocatesBeforeTraining(lightning.Callback):
    """Allocates and frees BIG bytes where planning and probing happen: at fit start, at train start and
    in on_train_batch_start of the first batch (where ActivationMemory's auto plan profiles a step)."""

    def __init__(self, device="cpu"):
        self.device = device
        self.rss_at_fit_start = 0

    def _allocate(self):
        big = torch.ones(BIG // 4, device=self.device)  # every page written: resident
        del big

    def on_fit_start(self, trainer, pl_module):
        self.rss_at_fit_start = current_rss_bytes()
        self._allocate()

    def on_train_start(self, trainer, pl_module):
        self._allocate()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self._allocate()


class _FirstStepAllocates(DemoGPT):
    """The first ``training_step`` call (ActivationMemory's profiling step, made at the first batch)
    allocates BIG bytes; the real steps do not."""

    def __init__(self, device="cpu", **kwargs):
        super().__init__(**kwargs)
        self.alloc_device, self.calls = device, 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        if self.calls == 1:
            big = torch.ones(BIG // 4, device=self.alloc_device)
            del big
        return super().training_step(batch, batch_idx)


def _fit_after_planning(small_datamodule_kwargs, accelerator):
    from lightning_efficient import ActivationMemory

    device = "cuda" if accelerator == "cuda" else "cpu"
    before = _AllocatesBeforeTraining(device)
    report = MemoryReport(every_n_steps=1, log=False, print_table=False)
    model = _FirstStepAllocates(device, **tiny_gpt_kwargs())
    # MemoryReport first: the callbacks after it (the auto plan) still run before the first step
    trainer = lightning.Trainer(
        accelerator=accelerator, devices=1, max_steps=3, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[report, before, ActivationMemory(policy="auto", budget=0.6)],
    )
    trainer.fit(model, datamodule=CorpusDataModule(**small_datamodule_kwargs))
    assert model.calls > 3  # the auto plan's profile did call the step (and allocated) before training
    assert vars(trainer.strategy).get("training_step") is None  # the one-shot wrapper is gone
    return report.report(), before


def test_peaks_cover_training_steps_only_not_planning_or_anything_before(small_datamodule_kwargs):
    figures, before = _fit_after_planning(small_datamodule_kwargs, "cpu")
    assert figures["steps"] == 3
    # a tiny model's training adds far less than BIG to the resident memory at fit start
    assert before.rss_at_fit_start > 0
    assert figures["peak_rss_bytes"] < before.rss_at_fit_start + BIG // 2
    assert 0 <= figures["rss_above_start_bytes"] < BIG // 2


class _TrainingHolds(DemoGPT):
    """Its second training step holds (writes) HELD more bytes while it runs."""

    def training_step(self, batch, batch_idx):
        held = torch.ones(HELD // 4) if batch_idx == 1 else None  # every page written: resident
        loss = super().training_step(batch, batch_idx)
        del held
        return loss


HELD = 160 * 2**20


def test_the_fits_own_memory_is_the_peak_rss_above_the_rss_when_the_fit_was_set_up(small_datamodule_kwargs):
    # what AutoFit's budget is held to on CPU: the whole process's peak counts the interpreter and the libraries too
    report = MemoryReport(every_n_steps=1, log=False, print_table=False)
    trainer = lightning.Trainer(accelerator="cpu", max_steps=3, limit_val_batches=0, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, callbacks=[report])
    trainer.fit(_TrainingHolds(**tiny_gpt_kwargs()), datamodule=CorpusDataModule(**small_datamodule_kwargs))
    figures = report.report()
    assert HELD <= figures["rss_above_start_bytes"] < HELD + 100 * 2**20
    assert figures["peak_rss_bytes"] - figures["rss_above_start_bytes"] > 100 * 2**20  # the interpreter, torch, Lightning


class _FiguresAfterEachStep(lightning.Callback):
    """A callback whose ``memory_figures`` change with every step (as AutoFit's measured peak appears after its steps)."""

    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps += 1

    def memory_figures(self) -> dict:
        return {"steps_seen_bytes": self.steps}


def test_the_final_figures_cover_every_step_not_only_the_sampled_ones(small_datamodule_kwargs):
    # sampled at the first step only (every 50): the second step's HELD bytes and what other callbacks read after the
    # first sample still reach the final table
    report = MemoryReport(every_n_steps=50, log=False, print_table=False)
    other = _FiguresAfterEachStep()
    trainer = lightning.Trainer(accelerator="cpu", max_steps=3, limit_val_batches=0, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, callbacks=[report, other])
    trainer.fit(_TrainingHolds(**tiny_gpt_kwargs()), datamodule=CorpusDataModule(**small_datamodule_kwargs))
    figures = report.report()
    assert figures["rss_above_start_bytes"] >= HELD
    assert figures["steps_seen_bytes"] == 3


def test_a_report_used_again_counts_the_next_fit_above_its_own_start(small_datamodule_kwargs):
    # memory held between two fits (here a tensor the caller keeps) is not the second fit's
    report = MemoryReport(every_n_steps=1, log=False, print_table=False)

    def fit(model) -> dict:
        trainer = lightning.Trainer(accelerator="cpu", max_steps=3, limit_val_batches=0, logger=False, enable_checkpointing=False,
                                    enable_progress_bar=False, enable_model_summary=False, callbacks=[report])
        trainer.fit(model, datamodule=CorpusDataModule(**small_datamodule_kwargs))
        return report.report()

    first = fit(_TrainingHolds(**tiny_gpt_kwargs()))
    kept = torch.ones(HELD // 4)  # every page written: resident through the second fit
    second = fit(DemoGPT(**tiny_gpt_kwargs()))
    assert first["rss_above_start_bytes"] >= HELD
    assert second["rss_above_start_bytes"] < HELD // 2  # neither the first fit's step nor what is kept since
    # the second fit's start (its peak less its own figure) holds what was kept since the first's
    start_moved = (second["peak_rss_bytes"] - second["rss_above_start_bytes"]) - (first["peak_rss_bytes"] - first["rss_above_start_bytes"])
    assert start_moved > 0.9 * HELD
    del kept


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_covers_training_steps_only(small_datamodule_kwargs):
    figures, _ = _fit_after_planning(small_datamodule_kwargs, "cuda")
    assert 0 < figures["cuda_max_allocated_bytes"] < BIG // 2


class _FakePagedAdamW8bit(bnb.optim.PagedAdamW8bit):
    """bitsandbytes' paged AdamW with its large buffers marked paged and registered with the page
    manager as ``get_paged`` does (CUDA managed memory does not exist on CPU)."""

    def get_state_buffer(self, p, dtype=torch.float32):
        buffer = torch.zeros(p.shape, dtype=dtype)
        if p.numel() >= 4096:
            buffer.is_paged = True
            self.page_mng.paged_tensors.append(buffer)
        return buffer

    def prefetch_state(self, p):
        pass


def test_paged_optimizer_bytes_are_reported_apart(small_datamodule_kwargs):
    from tests.optim.helpers import Regression

    class PagedRegression(Regression):
        def configure_optimizers(self):
            return _FakePagedAdamW8bit(self.parameters(), lr=1e-2)

    manager = bnb.functional.GlobalPageManager.get_instance()
    registered = list(manager.paged_tensors)
    try:
        model = PagedRegression()
        report = MemoryReport(every_n_steps=1, log=False, print_table=False)
        lightning.Trainer(
            accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[report],
        ).fit(model)
    finally:
        manager.paged_tensors[:] = registered
    paged = [p for p in model.parameters() if p.numel() >= 4096]
    assert len(paged) == 2  # the embedding and the hidden weight: uint8 state1 and state2 each
    assert report.report()["paged_optimizer_bytes"] == sum(2 * p.numel() for p in paged)
    assert "paged_optimizer_bytes" in report.table()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_paged_optimizer_bytes():
    from tests.optim.helpers import Regression

    class WidePaged(Regression):
        def __init__(self):
            super().__init__()
            self.hidden = torch.nn.Linear(80, 2048)  # 163,840 elements: bitsandbytes pages it
            self.out = torch.nn.Linear(2048, 1)

        def configure_optimizers(self):
            return bnb.optim.PagedAdamW8bit(self.parameters(), lr=1e-2)

    model = WidePaged()
    report = MemoryReport(every_n_steps=1, log=False, print_table=False)
    lightning.Trainer(
        accelerator="cuda", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[report],
    ).fit(model)
    assert report.report()["paged_optimizer_bytes"] == 2 * model.hidden.weight.numel()


class _WrapsTrainingStepAfterTheReport(lightning.Callback):
    """Another plugin that wraps the strategy's ``training_step`` after MemoryReport has wrapped it."""

    def __init__(self):
        self.calls = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            inner = trainer.strategy.training_step

            def training_step(*args, **kwargs):
                self.calls += 1
                return inner(*args, **kwargs)

            trainer.strategy.training_step = training_step


def test_a_wrapper_installed_after_the_reports_resets_peaks_and_counters_only_once(small_datamodule_kwargs):
    report = MemoryReport(every_n_steps=1, log=False, print_table=False)
    resets = []
    reset_peaks = report._reset_peaks
    report._reset_peaks = lambda pl_module: (resets.append(pl_module.global_step), reset_peaks(pl_module))
    outer = _WrapsTrainingStepAfterTheReport()
    trainer = lightning.Trainer(
        accelerator="cpu", devices=1, max_steps=3, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[report, outer],
    )
    trainer.fit(DemoGPT(**tiny_gpt_kwargs()), datamodule=CorpusDataModule(**small_datamodule_kwargs))
    assert outer.calls == 3  # the outer wrapper stayed in the chain, and with it the report's
    assert resets == [0, 0]  # at the first batch's start and at its strategy step; never again
    assert report.report()["steps"] == 3  # the step counters were not cleared at later steps


def test_loading_bitsandbytes_for_an_8bit_optimizer_is_not_counted_as_the_fits_memory(tmp_path):
    # its native libraries are tens of MiB of RSS, loaded when the optimizer is first swapped (after every setup); the
    # same fit with 32-bit states, in its own fresh process, pays every other first-time cost (code pages) alike
    import os
    import subprocess
    import sys

    figures = {}
    for states in ("8bit", "32bit"):
        out = tmp_path / f"{states}.json"
        done = subprocess.run([sys.executable, str(Path(__file__).with_name("report_fresh.py")), str(out), states],
                              capture_output=True, text=True, timeout=300, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
        assert done.returncode == 0, done.stderr[-3000:]
        figures[states] = json.loads(out.read_text())
    assert figures["8bit"]["bitsandbytes_loaded"] and not figures["32bit"]["bitsandbytes_loaded"]
    # a 17k-parameter model: its states are a few hundred KiB either way; bitsandbytes alone is over 40 MiB
    assert figures["8bit"]["rss_above_start_bytes"] - figures["32bit"]["rss_above_start_bytes"] < 16 * 2**20


@pytest.mark.parametrize("validated", [False, True], ids=["no_validation", "validation_at_the_end"])
def test_state_and_gradient_bytes_are_read_under_accumulation_where_the_sampled_step_has_none(small_datamodule_kwargs, validated):
    # sampled at the first batch only (every 50), which under accumulation is an optimizer step's first micro-batch:
    # no states yet, and the gradients not made; the window's optimizer step reads the gradients, the end of fit the
    # states (a new user's trial: with validation at the epoch's end, Lightning had released the gradients by then)
    report = MemoryReport(every_n_steps=50, log=False, print_table=False)
    length = {"max_epochs": 1, "limit_train_batches": 6, "limit_val_batches": 2} if validated else {"max_steps": 3, "limit_val_batches": 0}
    trainer = lightning.Trainer(accelerator="cpu", accumulate_grad_batches=2, logger=False, num_sanity_val_steps=0, **length,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[report])
    model = DemoGPT(**tiny_gpt_kwargs())
    trainer.fit(model, datamodule=CorpusDataModule(**small_datamodule_kwargs))
    figures = report.report()
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    assert figures["optimizer_state_bytes"] == sum(t.numel() * t.element_size() for state in trainer.optimizers[0].state.values()
                                                   for t in state.values() if torch.is_tensor(t))
    assert figures["optimizer_state_bytes"] >= 2 * parameters  # AdamW's two moments
    assert figures["gradient_bytes"] == parameters


class _TeardownMovesStates(lightning.pytorch.strategies.SingleDeviceStrategy):
    """On teardown, every optimizer state tensor becomes a copy of its own, as a CUDA run's states moved to the CPU
    one parameter at a time do (torch's ``.to("cpu")`` of a CPU tensor is the tensor itself)."""

    def teardown(self) -> None:
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value):
                        state[key] = value.clone()
        super().teardown()


def test_the_state_bytes_are_read_before_teardown_moves_the_states(small_datamodule_kwargs):
    # bitsandbytes' 8-bit states share two quantization maps; the CUDA teardown's move to the CPU copies them per
    # parameter, which read 2 KiB more per 8-bit parameter on an H200 (the report read again at fit end)
    from lightning_efficient import EightBitOptimizer

    report = MemoryReport(every_n_steps=1, log=False, print_table=False)
    states = _StatesAtTrainEnd()
    trainer = lightning.Trainer(accelerator="cpu", strategy=_TeardownMovesStates(torch.device("cpu")), max_steps=2,
                                limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, callbacks=[EightBitOptimizer(embeddings_32bit=False), report, states])
    trainer.fit(DemoGPT(**{**tiny_gpt_kwargs(), "d_model": 64}), datamodule=CorpusDataModule(**small_datamodule_kwargs))
    assert states.eight_bit >= 2  # several parameters share the maps
    assert report.report()["optimizer_state_bytes"] == states.bytes


class _StatesAtTrainEnd(lightning.Callback):
    def on_train_end(self, trainer, pl_module):
        from lightning_efficient.memory import optimizer_state_bytes

        self.bytes = optimizer_state_bytes(trainer.optimizers[0])
        self.eight_bit = sum(1 for s in trainer.optimizers[0].state.values() if "qmap1" in s)


class _TwoOptimizers(lightning.LightningModule):
    """Manual optimization stepping a small and a large optimizer each batch (a GAN's pattern)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.small, self.large = torch.nn.Linear(4, 4), torch.nn.Linear(4, 256)

    def training_step(self, batch, batch_idx):
        small_optimizer, large_optimizer = self.optimizers()
        for optimizer, layer in ((small_optimizer, self.small), (large_optimizer, self.large)):
            optimizer.zero_grad()
            self.manual_backward(layer(batch[0]).pow(2).mean())
            optimizer.step()

    def validation_step(self, batch, batch_idx):
        self.log("val", self.large(self.small(batch[0])).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.small.parameters(), lr=0.1), torch.optim.SGD(self.large.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2)

    val_dataloader = train_dataloader


def test_gradient_bytes_count_every_optimizers_step_of_a_sampled_batch_under_manual_optimization():
    # a review: read once a sampled batch, the gradients were the first optimizer's alone (288 bytes of 9,504)
    report = MemoryReport(every_n_steps=50, log=False, print_table=False)
    model = _TwoOptimizers()
    lightning.Trainer(accelerator="cpu", max_epochs=1, logger=False, num_sanity_val_steps=0, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[report]).fit(model)
    assert report.report()["gradient_bytes"] == sum(p.numel() * p.element_size() for p in model.parameters())
