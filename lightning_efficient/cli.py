"""The ``lightning-efficient`` command: a LightningCLI whose default config trains the demo."""

from __future__ import annotations

from importlib import resources

from lightning.pytorch.cli import LightningCLI

import lightning_efficient  # noqa: F401  (registers the package's strategies)


def default_config_path() -> str:
    """Path of the packaged default config (the demo with the plugins on)."""
    return str(resources.files("lightning_efficient.demo") / "default.yaml")


class EfficientCLI(LightningCLI):
    """LightningCLI for any LightningModule and DataModule given by ``class_path``; the packaged
    demo config is the default, so ``lightning-efficient fit`` alone trains the demo."""


def run_cli(args: list[str] | None = None) -> EfficientCLI:
    """Build and run the command line (``args`` defaults to ``sys.argv[1:]``); returns the CLI."""
    return EfficientCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_kwargs={
            command: {"default_config_files": [default_config_path()]}
            for command in ("fit", "validate", "test", "predict")
        },
        save_config_kwargs={"overwrite": True},
        args=args,
    )


def main() -> None:
    """Console-script entry point of ``lightning-efficient``."""
    run_cli()


if __name__ == "__main__":
    main()
