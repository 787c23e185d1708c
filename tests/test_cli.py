import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

from lightning_efficient.cli import default_config_path, run_cli, with_default_config

REPO = Path(__file__).resolve().parent.parent


def _cli(args, cwd):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "lightning_efficient.cli", *map(str, args)]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _tiny_corpus(root: Path) -> Path:
    """Four small text files: about 20 training batches of 4 x 32 tokens, fewer than the default
    config's val_check_interval of 80."""
    corpus = root / "corpus"
    corpus.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("bisect.py", "abc.py", "colorsys.py", "keyword.py"):
        (corpus / name).write_text((stdlib / name).read_text(encoding="utf-8")[:2000])
    return corpus


def _tiny(root: Path) -> list[str]:
    """Overrides that shrink the default config's demo to a few seconds of CPU."""
    return [
        "--data.init_args.data_path", str(_tiny_corpus(root)), "--data.init_args.cache_dir", str(root / "cache"),
        "--data.init_args.vocab_size", "300", "--model.init_args.vocab_size", "300",
        "--data.init_args.seq_len", "32", "--model.init_args.seq_len", "32",
        "--model.init_args.d_model", "32", "--model.init_args.n_heads", "2",
        "--data.init_args.batch_size", "4", "--trainer.strategy.init_args.global_batch_size", "4",
        "--trainer.limit_val_batches", "2",
    ]


def _printed_config(args, capsys) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        run_cli([*args, "--print_config"])
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def test_default_config_is_inserted_only_when_no_config_is_given():
    packaged = default_config_path()
    assert with_default_config(["fit", "--trainer.max_steps", "3"]) == ["fit", "--config", packaged, "--trainer.max_steps", "3"]
    for given in (["fit", "--config", "a.yaml"], ["fit", "-c", "a.yaml"], ["fit", "--config=a.yaml"], ["--config", "a.yaml", "fit"]):
        assert with_default_config(given) == given
    assert with_default_config(["--help"]) == ["--help"]


def test_a_given_config_is_not_merged_over_the_demo_config(capsys):
    config = _printed_config(["fit", "--config", str(REPO / "configs" / "tokens.yaml")], capsys)
    assert config["trainer"]["strategy"] == "auto"
    assert config["trainer"]["gradient_clip_val"] is None
    classes = [c["class_path"] for c in config["trainer"]["callbacks"]]
    assert classes == ["lightning_efficient.SelectiveTokenLoss", "lightning_efficient.MemoryReport"]


def test_without_config_the_packaged_demo_config_applies(capsys):
    config = _printed_config(["fit", "--trainer.max_steps", "7"], capsys)
    assert config["trainer"]["strategy"]["class_path"] == "lightning_efficient.HeterogeneousDDPStrategy"
    assert config["trainer"]["gradient_clip_val"] == 1.0
    assert config["trainer"]["max_steps"] == 7  # the command line still overrides it
    assert config["model"]["class_path"] == "lightning_efficient.DemoGPT"


def test_one_copy_of_the_demo_config():
    assert not (REPO / "configs" / "demo.yaml").exists()
    assert not (REPO / "config.yaml").exists()
    makefile = (REPO / "Makefile").read_text()
    assert "lightning-efficient fit" in makefile and "configs/demo.yaml" not in makefile


def test_default_config_on_a_tiny_corpus_with_one_block_is_quiet_and_saves_no_config_here(tmp_path):
    # one run for three regressions: about 20 batches an epoch, so 40 steps run into a second epoch
    # below the default val_check_interval of 80; a single block; and the output a new user sees
    work = tmp_path / "work"
    work.mkdir()
    done = _cli(["fit", *_tiny(tmp_path), "--model.init_args.n_layers", "1", "--trainer.max_steps", "40"], cwd=work)
    output = done.stdout + done.stderr
    assert done.returncode == 0, done.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=40` reached" in output
    assert "ActivationMemory: 1 blocks" in output
    assert "MemoryReport" in done.stdout and "tokens_per_s" in done.stdout
    assert re.search(r"Epoch [1-9]", output)  # the progress bar is on, past the first epoch ...
    assert "/-2" not in output  # ... and shows no epoch limit of -2
    assert "sync_dist" not in output
    assert "LeafSpec" not in output and "kernels-community" not in output  # nothing a user cannot act on
    assert list(work.iterdir()) == []  # no config.yaml (nor anything else) in the working directory


_TEST_THEN_PREDICT = """
import sys
from lightning_efficient.cli import run_cli
args = sys.argv[1:]
tested = run_cli(["test", *args, "--trainer.limit_test_batches", "2", "--trainer.logger", "true"])
print("TEST_METRICS", sorted(tested.trainer.callback_metrics))
predicted = run_cli(["predict", *args, "--trainer.limit_predict_batches", "2"])
print("PREDICTIONS", [tuple(p.shape) for p in predicted.trainer.predict_loop.predictions])
"""


def test_test_and_predict_run_on_the_demo_and_save_the_config_in_the_log_dir(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    args = [*_tiny(tmp_path), "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path / "runs")]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _TEST_THEN_PREDICT, *args], cwd=work, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TEST_METRICS ['test_loss', 'test_ppl']" in done.stdout
    assert "PREDICTIONS [(4, 32), (4, 32)]" in done.stdout
    # the test run had a logger: its config is in its log dir; predict had none: default_root_dir
    runs = tmp_path / "runs"
    assert sorted(runs.rglob("config.yaml")) == [runs / "config.yaml", runs / "lightning_logs" / "version_0" / "config.yaml"]
    assert yaml.safe_load((runs / "lightning_logs" / "version_0" / "config.yaml").read_text())["trainer"]["limit_test_batches"] == 2
    assert yaml.safe_load((runs / "config.yaml").read_text())["trainer"]["limit_predict_batches"] == 2
    assert list(work.iterdir()) == []


def test_demo_config_fits_three_steps(tmp_path):
    """The packaged default at its real size (the standard library corpus), three steps."""
    done = _cli(["fit", "--trainer.max_steps", "3", "--trainer.limit_val_batches", "2",
                 "--trainer.enable_progress_bar", "false"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "MemoryReport" in done.stdout
    assert "tokens_per_s" in done.stdout


def test_a_value_one_of_the_packages_classes_refuses_is_said_in_one_line_and_a_users_own_keeps_its_traceback(tmp_path):
    # a new user's trial: ActivationMemory(budget="banana") in a config printed jsonargparse's wrapping and two
    # tracebacks (85 lines) around the one line that says what is wrong
    (tmp_path / "mine.py").write_text(
        "import lightning\n\nfrom lightning_efficient import ActivationMemory\n\n\n"
        "class Picky(lightning.Callback):\n    def __init__(self, level: int = 0):\n"
        "        raise ValueError(f'level={level} is not mine to take')\n\n\n"
        "class Wrapping(lightning.Callback):\n    def __init__(self, budget: str = '1GiB'):\n        try:\n"
        "            self.memory = ActivationMemory(policy='auto', budget=budget)\n        except ValueError as error:\n"
        "            raise ValueError(f'my setup: see my wiki for budget {budget}') from error\n\n\n"
        "class MyMemory(ActivationMemory):\n    pass\n")

    def run(command: str, callback: dict, *options: str) -> subprocess.CompletedProcess:
        config = tmp_path / "run.yaml"
        config.write_text(yaml.safe_dump({
            "trainer": {"accelerator": "cpu", "max_steps": 1, "logger": False, "callbacks": [callback]},
            "model": {"class_path": "lightning_efficient.DemoGPT"},
            "data": {"class_path": "lightning_efficient.CorpusDataModule", "init_args": {"data_path": str(tmp_path)}},
        }))
        return _cli([command, "--config", config, *options], cwd=tmp_path)

    said = "budget='banana' is not allowed: expected bytes > 0, e.g. 6GiB, 500MB or 0.5 (a fraction)"
    banana = {"policy": "auto", "budget": "banana"}
    for command, options, prefix in (("fit", (), "lightning-efficient"), ("plan", ("--budget", "1GiB"), "lightning-efficient plan")):
        refused = run(command, {"class_path": "lightning_efficient.ActivationMemory", "init_args": banana}, *options)
        assert refused.returncode == 1
        assert refused.stderr.strip().splitlines()[-1] == f"{prefix}: ActivationMemory: {said}"
        assert "Traceback" not in refused.stderr
    # a user's subclass of one of ours: our refusal, named by their class
    subclass = run("fit", {"class_path": "mine.MyMemory", "init_args": banana})
    assert subclass.stderr.strip().splitlines()[-1] == f"lightning-efficient: MyMemory: {said}"
    # a class of the user's raises as LightningCLI raises it, also where it built one of ours and raised its own
    # error from ours: its traceback and its message are theirs to read
    for callback, theirs in (({"class_path": "mine.Picky", "init_args": {"level": 3}}, "level=3 is not mine to take"),
                             ({"class_path": "mine.Wrapping", "init_args": {"budget": "banana"}}, "my setup: see my wiki")):
        raised = run("fit", callback)
        assert raised.returncode == 1 and "Traceback" in raised.stderr and theirs in raised.stderr
        assert "lightning-efficient: " not in raised.stderr


def test_block_settings_refused_when_the_fit_starts_are_said_in_one_line(tmp_path):
    # a new user's trial: a policy list of the wrong length, or blocks matching nothing, printed a 35-line traceback
    corpus = _tiny_corpus(tmp_path)
    model = {"class_path": "lightning_efficient.DemoGPT", "init_args": {"vocab_size": 300, "seq_len": 32, "d_model": 32, "n_heads": 2}}
    data = {"class_path": "lightning_efficient.CorpusDataModule", "init_args": {
        "data_path": str(corpus), "cache_dir": str(tmp_path / "cache"), "vocab_size": 300, "seq_len": 32, "batch_size": 4}}
    for init_args, said in (({"policy": ["keep", "keep", "keep"]}, "ActivationMemory: policy=['keep', 'keep', 'keep'] is not "
                                                                    "allowed: expected one policy or a list of 4 (one per block found)."),
                            ({"blocks": ["nothere.*"]}, "blocks=['nothere.*'] matches no module; candidates: ")):
        config = tmp_path / "run.yaml"
        config.write_text(yaml.safe_dump({
            "trainer": {"accelerator": "cpu", "max_steps": 1, "logger": False, "enable_checkpointing": False,
                        "callbacks": [{"class_path": "lightning_efficient.ActivationMemory", "init_args": init_args}]},
            "model": model, "data": data}))
        refused = _cli(["fit", "--config", config], cwd=tmp_path)
        assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
        assert refused.stderr.strip().splitlines()[-1].startswith(f"lightning-efficient: {said}")


def test_a_budget_no_plan_meets_is_said_in_one_line_by_fit_as_by_plan(tmp_path):
    # a new user's trial: `lightning-efficient fit` printed a 30-line traceback (80 lines from 2 FSDP2 ranks) for AutoFit's
    # BudgetTooSmall, which `plan` says in one line, and for ActivationMemory(policy="auto")'s budget no plan meets
    corpus = _tiny_corpus(tmp_path)
    model = {"class_path": "lightning_efficient.DemoGPT", "init_args": {"vocab_size": 300, "seq_len": 32, "d_model": 32, "n_heads": 2}}
    data = {"class_path": "lightning_efficient.CorpusDataModule", "init_args": {
        "data_path": str(corpus), "cache_dir": str(tmp_path / "cache"), "vocab_size": 300, "seq_len": 32, "batch_size": 4}}
    for callback, said in (
            ({"class_path": "lightning_efficient.AutoFit", "init_args": {"budget": "1MiB"}},
             "AutoFit: no configuration fits the budget. rank 0: budget 1.0 MiB"),
            ({"class_path": "lightning_efficient.ActivationMemory", "init_args": {"policy": "auto", "budget": 1000}},
             "ActivationMemory(policy='auto') could not plan: rank 0 (micro-batch 4): budget=1,000 bytes is below what the "
             "leanest plan reaches: ")):
        config = tmp_path / "run.yaml"
        config.write_text(yaml.safe_dump({
            "trainer": {"accelerator": "cpu", "max_steps": 1, "logger": False, "enable_checkpointing": False,
                        "callbacks": [callback]},
            "model": model, "data": data}))
        refused = _cli(["fit", "--config", config], cwd=tmp_path)
        assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
        assert refused.stderr.strip().splitlines()[-1].startswith(f"lightning-efficient: {said}"), refused.stderr[-1000:]


def test_the_one_line_is_the_note_that_names_every_failed_rank_and_never_a_note_without_the_refusal():
    from lightning_efficient._validation import SettingRefused
    from lightning_efficient.cli import _in_one_line

    refusal = SettingRefused("budget=1,000 bytes is below what the leanest plan reaches")
    assert _in_one_line(refusal) == str(refusal)
    together = "ActivationMemory(policy='auto') could not plan: rank 0 (micro-batch 4): " + str(refusal)
    refusal.add_note(together)
    assert _in_one_line(refusal) == together
    # a note of the user's (a Callback.on_exception adding their run's name, a review) does not replace the refusal
    refusal.add_note("run 7 of the sweep")
    assert _in_one_line(refusal) == together
    assert _in_one_line(SettingRefused("shares=[1] has 1 entry")) == "shares=[1] has 1 entry"


def test_a_fraction_for_autofits_budget_in_a_config_is_refused_in_one_line(tmp_path):
    # a new user's trial: `budget: 0.5` (as ActivationMemory takes) printed 74 lines of jsonargparse's type check
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "trainer": {"accelerator": "cpu", "max_steps": 1, "logger": False,
                    "callbacks": [{"class_path": "lightning_efficient.AutoFit", "init_args": {"budget": 0.5}}]},
        "model": {"class_path": "lightning_efficient.DemoGPT"},
        "data": {"class_path": "lightning_efficient.CorpusDataModule", "init_args": {"data_path": str(tmp_path)}},
    }))
    refused = _cli(["fit", "--config", config], cwd=tmp_path)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        "lightning-efficient: AutoFit: budget=0.5 is not allowed: expected bytes (an int > 0), a size string like '6GiB', "
        "'auto', or a list of those (one per rank) (not a fraction: AutoFit's budget is memory)")


def test_a_strategy_value_the_strategy_refuses_is_said_in_one_line_too(tmp_path):
    # trainer.strategy is a union (a name or a Strategy): jsonargparse chains only the first type's mismatch ("Expected
    # a <class 'str'>"), and the refusal came with 60 lines of traceback
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "trainer": {"accelerator": "cpu", "max_steps": 1, "logger": False,
                    "strategy": {"class_path": "lightning_efficient.HeterogeneousDDPStrategy", "init_args": {"hysteresis": 2.0}}},
        "model": {"class_path": "lightning_efficient.DemoGPT"},
        "data": {"class_path": "lightning_efficient.CorpusDataModule", "init_args": {"data_path": str(tmp_path)}},
    }))
    refused = _cli(["fit", "--config", config], cwd=tmp_path)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        "lightning-efficient: HeterogeneousDDPStrategy: hysteresis=2.0 is not allowed: expected a fraction in [0, 1).")


def test_autofits_plan_only_under_ddp_spawn_is_refused_in_one_line_before_the_processes_start(tmp_path):
    # raised in the spawned processes, the refusal came back inside their traceback (a new user's trial)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "trainer": {"accelerator": "cpu", "devices": 2, "strategy": "ddp_spawn", "max_steps": 1, "logger": False,
                    "callbacks": [{"class_path": "lightning_efficient.AutoFit", "init_args": {"budget": "1GiB", "plan_only": True}}]},
        "model": {"class_path": "lightning_efficient.DemoGPT"},
        "data": {"class_path": "lightning_efficient.CorpusDataModule", "init_args": {"data_path": str(tmp_path)}},
    }))
    refused = _cli(["fit", "--config", config], cwd=tmp_path)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert refused.stderr.strip().splitlines()[-1] == (
        "lightning-efficient: AutoFit: plan_only=True is not allowed: expected False under a strategy that spawns its "
        "processes (the plan would be made, and lost, in them): plan under strategy='ddp', which gives the same plan, or "
        "with `lightning-efficient plan`.")
