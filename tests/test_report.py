import json
from pathlib import Path

import lightning
import pytest

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
    assert figures["activation_bytes"] > 0
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
    for name in ("peak_rss_bytes", "activation_bytes"):
        per_rank = [figures[f"rank{rank}/{name}"] for rank in (0, 1)]
        assert min(per_rank) > 0 and figures[name] == max(per_rank)
    # rank 1's micro-batch is three times rank 0's: so are the activations it saves, about
    assert figures["rank1/activation_bytes"] > 2 * figures["rank0/activation_bytes"]
    # every rank reports the same run figures; the table says what they are
    rank1 = json.loads(Path(f"{out}.rank1").read_text())
    assert rank1["samples_per_step"] == 8.0 and rank1["rank0/peak_rss_bytes"] == figures["rank0/peak_rss_bytes"]
    assert "2 ranks" in done.stdout and "rank1/peak_rss_bytes" in done.stdout

