"""The ``lightning-efficient`` command: a LightningCLI whose default config trains the demo."""

from __future__ import annotations

import argparse
import inspect
import sys
import warnings
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE
from lightning.pytorch.utilities.parsing import lightning_hasattr
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

import lightning_efficient  # noqa: F401  (registers the package's strategies)
from lightning_efficient._distributed import destroy_process_group_at_exit
from lightning_efficient._validation import SettingRefused
from lightning_efficient.activations.policies import policy_counts
from lightning_efficient.autofit import AutoFit, BudgetTooSmall, FitPlan

SUBCOMMANDS = ("fit", "validate", "test", "predict")

if _RICH_AVAILABLE:
    from lightning.pytorch.callbacks import RichProgressBar

    class StepsProgressBar(RichProgressBar):
        """Lightning's rich progress bar, reading ``Epoch 3`` rather than ``Epoch 3/-2`` when the fit
        has no epoch limit (``max_steps`` alone bounds it); with ``max_epochs`` set it is unchanged."""

        @override
        def _get_train_description(self, current_epoch: int) -> str:
            max_epochs = self.trainer.max_epochs
            if max_epochs is not None and max_epochs >= 0:
                return super()._get_train_description(current_epoch)
            description = f"Epoch {current_epoch}"
            width = len(self.validation_description)
            return f"{description:{width}}" if width > len(description) else description
else:  # pragma: no cover - rich is a dependency of lightning's extras, not of lightning
    StepsProgressBar = None


def default_config_path() -> str:
    """Path of the packaged default config (the demo with the plugins on)."""
    return str(resources.files("lightning_efficient.demo") / "default.yaml")


def _gives_config(args: Sequence[str]) -> bool:
    return any(a in ("-c", "--config") or a.startswith("--config=") for a in args)


def with_default_config(args: Sequence[str]) -> list[str]:
    """``args`` with ``--config <packaged default>`` inserted after the subcommand when no
    ``--config`` is given anywhere; unchanged otherwise (or when there is no subcommand).

    The packaged demo config is thus the default of ``lightning-efficient fit`` alone, and never
    merged under a config the user gives.
    """
    args = list(args)
    if _gives_config(args):
        return args
    position = next((i for i, a in enumerate(args) if a in SUBCOMMANDS), None)
    if position is None:
        return args
    return [*args[: position + 1], "--config", default_config_path(), *args[position + 1 :]]


class RunDirConfigSaver(SaveConfigCallback):
    """Saves the run's config as ``config.yaml`` in the run's log directory (the first logger's,
    e.g. ``lightning_logs/version_0``), or in ``trainer.default_root_dir`` when there is no logger
    and that directory was set elsewhere than the working directory; with neither, the config is not
    saved (``--print_config`` prints it), so no ``config.yaml`` lands in the working directory."""

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Save as Lightning does, unless the only place would be the working directory."""
        if not trainer.loggers and Path(trainer.default_root_dir).resolve() == Path.cwd().resolve():
            return
        super().setup(trainer, pl_module, stage)


class ConfigValueError(ValueError):
    """A value in the config that one of this package's classes refused as it was built (its own message, the
    class that refused it); the ``lightning-efficient`` command prints it in one line, without a traceback."""


def _refusal_of_ours(error: BaseException) -> ConfigValueError | None:
    """Where jsonargparse called the constructor of one of this package's classes and it raised a ValueError (the
    error itself, or one in its chain of causes: jsonargparse wraps it), that refusal as a :class:`ConfigValueError`
    naming the class; None otherwise. A user's class that builds one of ours and raises its own error keeps its
    traceback, as does any error jsonargparse neither chains nor lists (a union-typed key, such as
    ``trainer.strategy``, chains only the first type's mismatch: the other types' are read where jsonargparse
    listed them)."""
    seen: set[int] = set()
    waiting: list[BaseException] = [error]
    while waiting:
        chained = waiting.pop(0)
        if id(chained) in seen:
            continue
        seen.add(id(chained))
        if isinstance(chained, ValueError):
            owner = _constructor_called_by_jsonargparse(chained)
            if owner is not None:
                if owner:
                    return ConfigValueError(f"{owner}: {chained}")
                continue  # a user's class refused it: theirs to read
        waiting += [e for e in (chained.__cause__, chained.__context__) if e is not None]
        waiting += _union_alternatives(chained)
    return None


def _union_alternatives(error: BaseException) -> list[BaseException]:
    """The errors jsonargparse met trying each type of a union-typed key, where ``error`` is the one it raised for
    them all (it chains only the first; the others are in the frame that raised it)."""
    alternatives: list[BaseException] = []
    frame = error.__traceback__
    while frame is not None:
        code, scope = frame.tb_frame.f_code, frame.tb_frame.f_globals
        if code.co_name == "raise_union_unexpected_value" and str(scope.get("__name__", "")).startswith("jsonargparse"):
            listed = frame.tb_frame.f_locals.get("exceptions")
            alternatives += [e for e in listed if isinstance(e, BaseException)] if isinstance(listed, list) else []
        frame = frame.tb_next
    return alternatives


def _constructor_called_by_jsonargparse(error: BaseException) -> str | None:
    """The name of the class whose ``__init__`` jsonargparse called directly in ``error``'s traceback: the class's
    name where that ``__init__`` is this package's code, "" where it is not (a user's), None where there is no such
    call (the error was raised elsewhere and chained)."""
    frame, caller = error.__traceback__, None
    while frame is not None:
        code, scope = frame.tb_frame.f_code, frame.tb_frame.f_globals
        if code.co_name == "__init__" and "self" in frame.tb_frame.f_locals:
            if caller is None or not str(caller.tb_frame.f_globals.get("__name__", "")).startswith("jsonargparse"):
                return None
            ours = str(scope.get("__name__", "")).split(".")[0] == "lightning_efficient"
            return type(frame.tb_frame.f_locals["self"]).__name__ if ours else ""
        caller, frame = frame, frame.tb_next
    return None


class EfficientCLI(LightningCLI):
    """LightningCLI for any LightningModule and DataModule given by ``class_path``.

    Without ``--config`` the packaged demo config (:func:`default_config_path`) is used, so
    ``lightning-efficient fit`` alone trains the demo; with ``--config`` only the given files apply.
    The config is saved in the run's log directory (:class:`RunDirConfigSaver`), and the rich
    progress bar omits the epoch limit when there is none (:class:`StepsProgressBar`).
    """

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse ``args`` (``sys.argv[1:]`` when None) with the packaged config inserted when no
        ``--config`` is given (:func:`with_default_config`); dicts and Namespaces as LightningCLI does."""
        if args is None or (isinstance(args, (list, tuple)) and all(isinstance(a, str) for a in args)):
            self.config = parser.parse_args(with_default_config(sys.argv[1:] if args is None else args))
        else:
            super().parse_arguments(parser, args)

    @override
    def instantiate_classes(self) -> None:
        """Build the config's classes; a value one of this package's classes refuses is a :class:`ConfigValueError`."""
        try:
            super().instantiate_classes()
        except ValueError as error:
            refusal = _refusal_of_ours(error)
            if refusal is None:
                raise
            raise refusal from error

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The Trainer, with :class:`StepsProgressBar` where Lightning would add its default rich bar."""
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        trainer_config = {**(config.get("trainer") or {}), **kwargs}
        callbacks = trainer_config.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        wants_bar = trainer_config.get("enable_progress_bar", True) is not False
        if StepsProgressBar is not None and wants_bar and not any(isinstance(c, ProgressBar) for c in callbacks):
            kwargs["callbacks"] = [*callbacks, StepsProgressBar()]
        return super().instantiate_trainer(**kwargs)

    def before_fit(self) -> None:
        """Refuse an AutoFit's ``plan_only`` under a strategy that spawns its processes before they start, in one line
        (raised in them, it came back wrapped in their traceback)."""
        for callback in self.trainer.callbacks:
            if isinstance(callback, AutoFit):
                callback.refuse_plan_only_where_spawned(self.trainer)


def run_cli(args: list[str] | None = None) -> EfficientCLI:
    """Build and run the command line (``args`` defaults to ``sys.argv[1:]``); returns the CLI."""
    return EfficientCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_callback=RunDirConfigSaver,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


PLAN_USAGE = """usage: lightning-efficient plan [--config CONFIG] [--budget BUDGET] [--margin MARGIN] [fit options ...]

Build the run as `lightning-efficient fit` would (same config and options), measure it and print AutoFit's
plan and the YAML settings that fit with it, without training. --budget (bytes, a size like 6GiB, 'auto',
or a list like [6GiB,12GiB], one per rank) is required unless the config has an AutoFit callback."""


def _parse_value(text: str) -> Any:
    import yaml

    value = yaml.safe_load(text)
    return value if isinstance(value, (int, list)) and not isinstance(value, bool) else text


def plan_yaml(plan: FitPlan, autofit: AutoFit, trainer: Trainer, model: LightningModule) -> str:
    """The plan as settings for a config file: fixed settings where every rank has the same plan (a fit with
    them trains as AutoFit's would, without measuring), else the AutoFit callback itself, held to the plan's micro-batch
    and optimizer states; that too where the plan splits the batch and the run counts training batches
    (``AutoFit.batch_counting``), which AutoFit counts in micro-batches as it fits, or an epoch's short last batch
    (``AutoFit.short_last_batch``), which it weighs."""
    import yaml

    policies = {tuple(r.policies) for r in plan.ranks}
    if len(policies) > 1 or autofit.batch_counting or autofit.short_last_batch:
        # AutoFit kept, pinned to the printed plan's micro-batch and optimizer states (a new user's trial: kept as a
        # whole search, its fit measured again and could pick otherwise than the table above the config)
        pinned = autofit.init_args()
        if plan.accumulation is not None and autofit.search_micro_batch:
            pinned["micro_batches"] = plan.micro_batches[:1]
        if plan.optimizer in autofit.optimizer_options:
            pinned["optimizer_options"] = [plan.optimizer]
        return yaml.safe_dump({"trainer": {"callbacks": [{"class_path": "lightning_efficient.AutoFit", "init_args": pinned}]}},
                              sort_keys=False)
    callbacks: list[dict[str, Any]] = []
    (chosen,) = policies
    if chosen and any(p != "keep" for p in chosen):
        args: dict[str, Any] = {"policy": list(chosen)}
        if autofit.blocks != "auto":
            args["blocks"] = autofit.blocks
        callbacks.append({"class_path": "lightning_efficient.ActivationMemory", "init_args": args})
    if plan.optimizer.startswith("8-bit"):
        args = {"min_8bit_size": autofit.min_8bit_size}
        if plan.optimizer == "8-bit paged":
            args["paged"] = True
        if plan.optimizer == "8-bit offload":
            args["offload"] = "cpu"
        callbacks.append({"class_path": "lightning_efficient.EightBitOptimizer", "init_args": args})
    if plan.accumulation is not None and plan.accumulation > trainer.accumulate_grad_batches:
        # the plan splits the batch: the token mean over the step's micro-batches AutoFit keeps (a new user's trial: the
        # config without it trained 7e-2 away from AutoFit's fit, on padded rows returning TokenLosses)
        callbacks.append({"class_path": "lightning_efficient.StepTokenMean", "init_args": {}})
    settings: dict[str, Any] = {"trainer": {}}
    if plan.accumulation is None:
        settings["trainer"]["strategy"] = {"init_args": {"max_micro_batch": plan.micro_batches}}
    else:
        settings["trainer"]["accumulate_grad_batches"] = plan.accumulation
        if autofit.epoch_micro_batches is not None:  # (a DataLoader dropping its last batch: plain Lightning's samples)
            settings["trainer"]["limit_train_batches"] = autofit.epoch_micro_batches
        holder = "data" if trainer.datamodule is not None and hasattr(trainer.datamodule, "batch_size") else "model"
        if lightning_hasattr(model, "batch_size"):
            settings[holder] = {"init_args": {"batch_size": plan.micro_batches[0]}}
    if callbacks:
        settings["trainer"]["callbacks"] = callbacks
    return yaml.safe_dump(settings, sort_keys=False)


def _launch_as_a_script(trainer: Any) -> None:
    """A strategy that spawns its processes (``ddp_spawn``) launches them as ``ddp`` does instead, each running this
    command again: the plan, the same, is then made in this process too, which prints it and its config (the config
    keeps the strategy as written). AutoFit refuses ``plan_only`` in spawned processes, where the plan is lost."""
    strategy = trainer.strategy
    # (the processes run this command line again: only where it is this command, not a plan made in-process)
    if sys.argv[1:2] != ["plan"]:
        return
    if isinstance(strategy.launcher, _MultiProcessingLauncher) and getattr(strategy, "_start_method", None) is not None:
        strategy._start_method = "popen"
        strategy._configure_launcher()


def run_plan(args: Sequence[str]) -> AutoFit:
    """``lightning-efficient plan``: see :data:`PLAN_USAGE`. Returns the AutoFit callback that planned."""
    if any(a in ("-h", "--help") for a in args):
        print(PLAN_USAGE)
    parser = argparse.ArgumentParser(prog="lightning-efficient plan", add_help=False)
    parser.add_argument("--budget", type=_parse_value)
    parser.add_argument("--margin", type=float)
    known, rest = parser.parse_known_args(list(args))
    try:  # a wrong --budget or --margin is said at once, in one line (before the config's model is built)
        AutoFit(budget="auto" if known.budget is None else known.budget, margin=0.10 if known.margin is None else known.margin)
    except ValueError as error:
        raise SystemExit(f"lightning-efficient plan: {error}") from None
    if not _gives_config(rest):
        rest = ["--config", default_config_path(), *rest]
    cli = EfficientCLI(subclass_mode_model=True, subclass_mode_data=True, save_config_callback=None, args=rest, run=False)
    trainer = cli.trainer
    autofit = next((c for c in trainer.callbacks if isinstance(c, AutoFit)), None)
    if autofit is None:
        if known.budget is None:
            raise SystemExit("lightning-efficient plan: give --budget (or an AutoFit callback in the config)\n\n" + PLAN_USAGE)
        autofit = AutoFit(budget=known.budget, margin=0.10 if known.margin is None else known.margin)
        trainer.callbacks.insert(0, autofit)
    elif known.budget is not None or known.margin is not None:
        autofit = AutoFit(**{**autofit.init_args(),
                             **({"budget": known.budget} if known.budget is not None else {}),
                             **({"margin": known.margin} if known.margin is not None else {})})
        index = next(i for i, c in enumerate(trainer.callbacks) if isinstance(c, AutoFit))
        trainer.callbacks[index] = autofit
    autofit.plan_only = True
    _launch_as_a_script(trainer)
    # nothing trained, nothing logged: no empty run directory left behind (a new user's trial); a logger of no-ops in
    # each one's place, for callbacks and modules that ask for one in setup (DeviceStatsMonitor refuses none)
    trainer.loggers = [DummyLogger() for _ in trainer.loggers]
    trainer.fit(cli.model, datamodule=cli.datamodule)
    if trainer.is_global_zero and autofit.plan is not None:
        import yaml

        settings = plan_yaml(autofit.plan, autofit, trainer, cli.model)
        planned = yaml.safe_load(settings)
        if "limit_train_batches" in (planned.get("trainer") or {}):  # (AutoFit.epoch_micro_batches)
            print(f"\n# Your DataLoader drops its last incomplete batch, which the plan's micro-batch drops less of: "
                  f"limit_train_batches: {autofit.epoch_micro_batches} keeps each epoch to the samples of your whole "
                  "batches (of this dataset's size), as AutoFit does.")
        stays = why_autofit_stays(autofit.plan, autofit.batch_counting, autofit.short_last_batch)
        for why in stays:
            print(f"\n# {why}")
        try:
            # skip_none=False: a setting the config sets to null over a non-null default (check_val_every_n_epoch) stays null
            whole = planned_config(yaml.safe_load(cli.parser.dump(cli.config, skip_validation=True, skip_none=False)),
                                   planned, trainer)
        except Exception as error:  # noqa: BLE001 - a config jsonargparse cannot write back: the settings alone
            print(f"\n# (no whole config: {error}) AutoFit's plan as settings for your config (the same global batch):")
            print(settings)
        else:
            kept = "with AutoFit kept (above)" if stays else "with the plan's settings in place of AutoFit"
            print(f"\n# AutoFit's plan as a whole config, yours {kept} (the same global batch): save it and give it alone "
                  "to `lightning-efficient fit --config`")
            print(yaml.safe_dump(whole, sort_keys=False))
    return autofit


def why_autofit_stays(plan: FitPlan, batch_counting: list[str], short_last_batch: int | None = None) -> list[str]:
    """Why the config ``plan`` prints keeps AutoFit rather than the plan's settings (:func:`plan_yaml`), a line each:
    the ranks plan their blocks differently (a new user's trial: the config kept AutoFit, and its comment said the
    plan's settings replaced it), the plan splits the batch where the config counts batches (``batch_counting``:
    :attr:`AutoFit.batch_counting`), or it splits an epoch's short last batch (``short_last_batch``:
    :attr:`AutoFit.short_last_batch`). Empty where the plan's settings replace it."""
    why = []
    if len({tuple(r.policies) for r in plan.ranks}) > 1:
        each = "; ".join(f"rank {rank}: {policy_counts(r.policies)}" for rank, r in enumerate(plan.ranks))
        why.append(f"The ranks plan their blocks differently ({each}), which one config's callbacks cannot hold: AutoFit "
                   "stays, and plans them again when the fit starts.")
    if batch_counting:
        why.append(f"The plan splits each batch, and your config counts batches ({'; '.join(batch_counting)}): AutoFit "
                   "counts them in its micro-batches as it fits, which fixed settings cannot, so AutoFit stays.")
    if short_last_batch:
        why.append(f"Each epoch ends on a short batch of {short_last_batch} samples, which the plan splits: AutoFit weighs "
                   "its micro-batches' losses as plain Lightning's step weighs that batch, which fixed settings cannot "
                   "(Lightning divides each by the accumulation alike), so AutoFit stays.")
    return why


def planned_config(config: dict[str, Any], settings: dict[str, Any], trainer: Trainer) -> dict[str, Any]:
    """The whole config of the run with the plan's settings in place.

    Args:
        config: the run's parsed config, as jsonargparse writes it.
        settings: :func:`plan_yaml`'s settings: its callbacks replace AutoFit, and a callback of the same class the
            config has is updated with them (AutoFit kept a user's ActivationMemory or EightBitOptimizer, whose other
            arguments stay); where they are AutoFit itself (ranks plan differently), the config's AutoFit stays with
            the budget and margin set. The trainer's values are set, a strategy keeps its class with the plan's
            arguments added, and the micro-batch goes into the model's or datamodule's ``batch_size`` argument.
        trainer: the planned run's trainer (the strategy's class where the config names it by a string).

    Raises:
        ValueError: where the micro-batch cannot be set by a ``batch_size`` constructor argument (the module or
            datamodule only has the attribute): no whole config sets it.
    """
    config = {k: v for k, v in config.items() if k != "config"}  # the paths it was read from
    trainer_config = dict(config.get("trainer") or {})
    config["trainer"] = trainer_config
    planned = dict(settings.get("trainer") or {})
    callbacks = trainer_config.get("callbacks") or []
    callbacks = list(callbacks) if isinstance(callbacks, list) else [callbacks]
    planned_callbacks = planned.pop("callbacks", [])
    for callback in planned_callbacks:
        name = callback["class_path"].rsplit(".", 1)[-1]
        same = [i for i, c in enumerate(callbacks) if _class_name(c) == name]
        if same:
            mine = callbacks[same[0]]
            # the config's own arguments stay: AutoFit kept what the user set (the plan's are the same), and the
            # plan's fill in the rest (an AutoFit the ranks plan with gets the budget and margin it was given)
            merged = {**callback["init_args"], **(mine.get("init_args") or {})}
            if name == "AutoFit":
                merged.update({k: callback["init_args"][k] for k in ("budget", "margin")})
                merged.pop("plan_only", None)  # (the config is one to fit with: a review)
            callbacks[same[0]] = {**mine, "init_args": merged}
        else:
            callbacks.append(callback)
    if not any(c["class_path"] == "lightning_efficient.AutoFit" for c in planned_callbacks):
        callbacks = [c for c in callbacks if _class_name(c) != "AutoFit"]
    trainer_config["callbacks"] = callbacks or None
    strategy = planned.pop("strategy", None)
    if strategy is not None:
        current = trainer_config.get("strategy")
        if not isinstance(current, dict):
            kind = type(trainer.strategy)
            current = {"class_path": f"{kind.__module__}.{kind.__qualname__}", "init_args": {}}
        current["init_args"] = {**(current.get("init_args") or {}), **strategy["init_args"]}
        trainer_config["strategy"] = current
    trainer_config.update(planned)
    for holder, instance in (("model", trainer.lightning_module), ("data", trainer.datamodule)):
        if holder not in settings:
            continue
        parameters = inspect.signature(type(instance).__init__).parameters
        if "batch_size" not in parameters and not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            raise ValueError(f"{type(instance).__name__} has a batch_size attribute but no batch_size argument: "
                             "a config cannot set the micro-batch")
        section = config.get(holder)
        section = dict(section) if isinstance(section, dict) else {}
        section["init_args"] = {**(section.get("init_args") or {}), **settings[holder]["init_args"]}
        config[holder] = section
    return config


def _class_name(entry: Any) -> str | None:
    """The class name of a config entry given as ``class_path``/``init_args`` (None for anything else)."""
    return str(entry.get("class_path", "")).rsplit(".", 1)[-1] if isinstance(entry, dict) else None


def main() -> None:
    """Console-script entry point of ``lightning-efficient`` (``fit``/``validate``/``test``/``predict``, and ``plan``)."""
    # Lightning 2.6's pytree helper trips torch's own deprecation of LeafSpec on every fit: nothing a
    # user of this command can act on (it is between Lightning and torch), so the command hides it
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)
    destroy_process_group_at_exit()  # a gloo group alive at exit can abort a run that did all it had to
    if sys.argv[1:2] == ["plan"]:
        try:
            run_plan(sys.argv[2:])
        except (BudgetTooSmall, SettingRefused, ConfigValueError) as refusal:  # the answer asked for, or a value refused: no traceback
            raise _said_once(f"lightning-efficient plan: {_in_one_line(refusal)}") from None
        return
    try:
        run_cli()
    except (ConfigValueError, SettingRefused, BudgetTooSmall) as refusal:  # a value or budget the run cannot take, in one line
        raise _said_once(f"lightning-efficient: {_in_one_line(refusal)}") from None


def _in_one_line(refusal: ValueError) -> str:
    """What to say of ``refusal``: the last note that carries its message (the one ranks failing together add names what
    failed and each failed rank, e.g. "ActivationMemory(policy='auto') could not plan: rank 0 (micro-batch 8):
    budget=..."), else its own message (a note of another's, e.g. a user's ``on_exception`` hook's, would lose it)."""
    message = str(refusal)
    return next((note for note in reversed(getattr(refusal, "__notes__", [])) if message in note), message)


def _said_once(message: str) -> SystemExit:
    """The exit that says ``message``: on rank 0 only, where several processes refuse alike (every rank raises a
    refusal found when the fit starts together, in the same words: a new user's refused budget under ddp was said
    twice); the other ranks exit with the same status."""
    return SystemExit(message if rank_zero_only.rank == 0 else 1)


if __name__ == "__main__":
    main()
