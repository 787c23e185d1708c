"""The ``lightning-efficient`` command: a LightningCLI whose default config trains the demo."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE
from typing_extensions import override

import lightning_efficient  # noqa: F401  (registers the package's strategies)

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


def run_cli(args: list[str] | None = None) -> EfficientCLI:
    """Build and run the command line (``args`` defaults to ``sys.argv[1:]``); returns the CLI."""
    return EfficientCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_callback=RunDirConfigSaver,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


def main() -> None:
    """Console-script entry point of ``lightning-efficient``."""
    # Lightning 2.6's pytree helper trips torch's own deprecation of LeafSpec on every fit: nothing a
    # user of this command can act on (it is between Lightning and torch), so the command hides it
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)
    run_cli()


if __name__ == "__main__":
    main()
