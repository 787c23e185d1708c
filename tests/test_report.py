import json

import lightning
import torch

from lightning_efficient import CorpusDataModule, DemoGPT, MemoryReport
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
    assert 0 < figures["activation_bytes"]
    # the logits and their log-softmax alone are saved: at least 2 x batch x seq x vocab floats
    assert figures["activation_bytes"] >= 2 * batch * seq * 512 * 4
    assert figures["tokens_per_s"] > 0 and figures["peak_rss_bytes"] > 0
    printed = capsys.readouterr().out
    assert "MemoryReport" in printed and "optimizer_state_bytes" in printed
    assert json.loads((tmp_path / "report.json").read_text())["optimizer_state_bytes"] == figures["optimizer_state_bytes"]


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
    import pytest

    with pytest.raises(ValueError, match="every_n_steps=0"):
        MemoryReport(every_n_steps=0)
