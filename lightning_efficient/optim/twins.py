"""Which bitsandbytes 8-bit optimizer is the twin of a given optimizer, and how to build it.

Every hyperparameter of every param group is carried over by keyword (bitsandbytes 0.50 removed
positional arguments, so positional calls would bind to other parameters). Options the twin cannot
honour are refused with a sentence saying why, never dropped silently.

bitsandbytes is imported when the table of twins is first needed, not when this module is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from lightning_efficient.optim._bnb import bitsandbytes

# torch implementation switches with no meaning for bitsandbytes (checked separately when they matter)
_IMPLEMENTATION_KEYS = {"foreach", "fused", "capturable", "differentiable", "maximize", "amsgrad", "decoupled_weight_decay"}


@dataclass(frozen=True)
class Twin:
    """An 8-bit twin: its class, its paged class (or None), and what it cannot honour.

    Attributes:
        eight_bit: the bitsandbytes 8-bit optimizer class.
        paged: the paged 8-bit class, or None where bitsandbytes has none.
        hyperparameters: the group keys the twin reads.
        refuse: ``fn(group) -> reason or None`` for settings it cannot honour.
        family: ``"adam"``, ``"momentum"``, ``"rmsprop"``, ``"adagrad"`` or ``"lion"``.

    bitsandbytes reads every family's coefficients from a group's ``betas``: momentum keeps
    ``(momentum, dampening)``, RMSprop ``(alpha, momentum)``, Adagrad ``(0, 0)``; :func:`build_twin`
    writes them per group so that groups with different coefficients keep them, and again before
    every step so that scheduled ``momentum``/``alpha`` are used (:func:`follow_torch_names`).
    """

    eight_bit: type[torch.optim.Optimizer]
    paged: type[torch.optim.Optimizer] | None
    hyperparameters: tuple[str, ...]
    refuse: Callable[[dict], str | None]
    family: str


def _common(group: dict) -> str | None:
    if group.get("maximize"):
        return "maximize=True (bitsandbytes optimizers only minimise)"
    return None


def _adam(decoupled: bool) -> Callable[[dict], str | None]:
    def refuse(group: dict) -> str | None:
        if group.get("amsgrad"):
            return "amsgrad=True (bitsandbytes' 8-bit Adam keeps no max of second moments)"
        if not decoupled and group.get("weight_decay", 0) and not group.get("decoupled_weight_decay", False):
            return (
                f"weight_decay={group['weight_decay']} with torch.optim.Adam's L2 penalty (bitsandbytes decays "
                "weights decoupled, as AdamW does: use torch.optim.AdamW for the same update)"
            )
        return _common(group)

    return refuse


def _sgd(group: dict) -> str | None:
    if group.get("nesterov"):
        return "nesterov=True (bitsandbytes' SGD8bit uses plain momentum)"
    if group.get("dampening", 0):
        return f"dampening={group['dampening']} (bitsandbytes' SGD8bit has no dampening)"
    return _common(group)


def _rmsprop(group: dict) -> str | None:
    if group.get("centered"):
        return "centered=True (bitsandbytes has no centered RMSprop)"
    if group.get("momentum", 0):
        return f"momentum={group['momentum']} (bitsandbytes' RMSprop8bit keeps no momentum buffer)"
    return _common(group)


def _adagrad(group: dict) -> str | None:
    if group.get("lr_decay", 0):
        return f"lr_decay={group['lr_decay']} (bitsandbytes' Adagrad8bit has no learning-rate decay)"
    if group.get("initial_accumulator_value", 0):
        return f"initial_accumulator_value={group['initial_accumulator_value']} (bitsandbytes' Adagrad8bit starts from 0)"
    return _common(group)


def _lion(group: dict) -> str | None:
    return _common(group)


_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")


@cache
def twins() -> dict[type, Twin]:
    """The twin of each supported optimizer class (imports bitsandbytes on the first call)."""
    bnb = bitsandbytes()
    return {
        torch.optim.AdamW: Twin(bnb.optim.AdamW8bit, bnb.optim.PagedAdamW8bit, _ADAM_KEYS, _adam(True), "adam"),
        torch.optim.Adam: Twin(bnb.optim.Adam8bit, bnb.optim.PagedAdam8bit, _ADAM_KEYS, _adam(False), "adam"),
        torch.optim.SGD: Twin(bnb.optim.SGD8bit, None, ("lr", "momentum", "dampening", "weight_decay", "nesterov"), _sgd, "momentum"),
        torch.optim.RMSprop: Twin(bnb.optim.RMSprop8bit, None, ("lr", "alpha", "eps", "weight_decay", "momentum", "centered"), _rmsprop, "rmsprop"),
        torch.optim.Adagrad: Twin(bnb.optim.Adagrad8bit, None, ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps"), _adagrad, "adagrad"),
        bnb.optim.AdamW: Twin(bnb.optim.AdamW8bit, bnb.optim.PagedAdamW8bit, _ADAM_KEYS, _adam(True), "adam"),
        bnb.optim.Adam: Twin(bnb.optim.Adam8bit, bnb.optim.PagedAdam8bit, _ADAM_KEYS, _adam(True), "adam"),
        bnb.optim.Lion: Twin(bnb.optim.Lion8bit, bnb.optim.PagedLion8bit, ("lr", "betas", "weight_decay"), _lion, "lion"),
    }


@cache
def eight_bit_classes() -> tuple[type[torch.optim.Optimizer], ...]:
    """Every bitsandbytes class a twin can be (8-bit and paged 8-bit), for ``isinstance`` checks."""
    table = twins().values()
    return tuple({t.eight_bit for t in table} | {t.paged for t in table if t.paged})


def __getattr__(name: str) -> Any:
    # the tables under their former constant names, built (and bitsandbytes imported) on first access
    if name == "TWINS":
        return twins()
    if name == "EIGHT_BIT_CLASSES":
        return eight_bit_classes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def supported_names() -> str:
    """The optimizers that have a twin, for error messages."""
    return ", ".join(f"{cls.__module__}.{cls.__name__}" for cls in twins())


def find_twin(optimizer: torch.optim.Optimizer) -> Twin | None:
    """The twin of ``optimizer``'s exact class (a subclass may change the update, so it has none)."""
    return twins().get(type(optimizer))


def is_stateless(optimizer: torch.optim.Optimizer) -> bool:
    """True for SGD without momentum and for Lightning's placeholder where ``configure_optimizers`` returns None: they
    keep no state, so there is nothing to quantize."""
    from lightning.pytorch.core.optimizer import _MockOptimizer

    if isinstance(optimizer, _MockOptimizer):
        return True
    return isinstance(optimizer, torch.optim.SGD) and all(g.get("momentum", 0) == 0 for g in optimizer.param_groups)


class NoTwinError(TypeError):
    """An optimizer has no 8-bit twin, or uses a setting its twin cannot honour."""


#: the group keys bitsandbytes reads from ``betas`` for each family that names them otherwise in torch
_TORCH_COEFFICIENTS = {"momentum": ("momentum", "dampening"), "rmsprop": ("alpha", "momentum")}


def constructor_defaults(family: str, defaults: dict[str, Any], groups: list[dict], accepted: tuple[str, ...] | set[str]) -> dict[str, Any]:
    """The keyword arguments to build a twin of ``family`` over ``groups`` with (each group keeps its own values;
    these are the defaults a group added later takes): the ``accepted`` keys of the optimizer's ``defaults`` (the
    first group's where it has none), but for SGD a momentum of 0 becomes the first group's with momentum, as
    bitsandbytes' SGD8bit refuses ``momentum=0`` while a group without momentum next to one with it trains as
    torch's does (a stateless SGD is never converted)."""
    defaults = {k: defaults[k] if k in defaults else groups[0][k] for k in accepted if k in defaults or k in groups[0]}
    if family == "momentum" and not defaults.get("momentum"):
        defaults["momentum"] = next((g["momentum"] for g in groups if g.get("momentum")), defaults.get("momentum", 0))
    return defaults


def _translate(family: str, group: dict) -> dict:
    if family == "momentum":
        group["betas"] = (group["momentum"], group.get("dampening", 0.0))
    elif family == "rmsprop":
        group["betas"] = (group["alpha"], group.get("momentum", 0.0))
    elif family == "adagrad":
        group["betas"] = (0.0, 0.0)
    return group


def family_of(optimizer: torch.optim.Optimizer) -> str | None:
    """The twin family of a bitsandbytes 8-bit ``optimizer`` (or a subclass of one), else None."""
    for twin in twins().values():
        for cls in (twin.eight_bit, twin.paged):
            if cls is not None and isinstance(optimizer, cls):
                return twin.family
    return None


def follow_torch_names(optimizer: torch.optim.Optimizer) -> None:
    """Make the 8-bit ``optimizer`` read its coefficients from torch's group keys at every step.

    bitsandbytes reads SGD's momentum and RMSprop's alpha from a group's ``betas``; a scheduler
    (``OneCycleLR``, ``CyclicLR`` with ``cycle_momentum``, a user's own) writes ``momentum`` or
    ``alpha``. A step pre-hook rewrites each group's ``betas`` from those keys before every step, so
    the scheduled values are the ones used. Adam, AdamW and Lion read ``betas`` as torch does: nothing
    to do.
    """
    family = family_of(optimizer)
    if family not in ("momentum", "rmsprop"):
        return
    # the defaults as torch's optimizer has them: its coefficients under torch's names and no ``betas``, which
    # bitsandbytes reads from the groups alone; a reader that takes ``betas`` when the defaults hold it (Lightning's
    # LearningRateMonitor, a OneCycleLR built on the twin) would otherwise read a value the hook refreshes only at the
    # next step
    betas = optimizer.defaults.pop("betas", None)
    if betas is not None:  # the constructor's: what a group added later takes (BaseFinetuning's unfrozen layers)
        for key, value in zip(_TORCH_COEFFICIENTS[family], betas):
            optimizer.defaults.setdefault(key, value)

    def translate(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in opt.param_groups:
            _translate(family, group)

    optimizer.register_step_pre_hook(translate)


def paged_refusal(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` cannot have a paged 8-bit twin (bitsandbytes has paged Adam, AdamW and Lion only), or None."""
    twin = find_twin(optimizer)
    if twin is None or twin.paged is not None:
        return None
    return (
        f"{type(optimizer).__module__}.{type(optimizer).__name__}'s 8-bit twin {twin.eight_bit.__name__} has no "
        "paged variant in bitsandbytes (only Adam, AdamW and Lion do)"
    )


def build_twin(
    optimizer: torch.optim.Optimizer, *, min_8bit_size: int, paged: bool, sharded: bool = False
) -> torch.optim.Optimizer:
    """The 8-bit twin of ``optimizer``: same parameters, param groups and hyperparameters.

    With ``sharded=True`` the twin steps the local shard of each DTensor parameter (FSDP2; see
    :mod:`lightning_efficient.optim.sharded`). Every group key is carried over (``initial_lr`` for schedulers and user keys included) except
    torch's implementation switches. Scheduled ``momentum``/``alpha`` keep reaching the update
    (:func:`follow_torch_names`). Existing state is not carried: convert it with
    :mod:`lightning_efficient.optim.state`.

    Raises:
        NoTwinError: naming the optimizer (and the supported ones) or the setting that cannot be honoured.
        ValueError: for ``paged=True`` where bitsandbytes has no paged twin.
    """
    twin = find_twin(optimizer)
    name = f"{type(optimizer).__module__}.{type(optimizer).__name__}"
    if twin is None:
        raise NoTwinError(f"{name} has no bitsandbytes 8-bit twin; supported: {supported_names()}")
    for index, group in enumerate(optimizer.param_groups):
        reason = twin.refuse(group)
        if reason:
            raise NoTwinError(f"{name} param group {index} cannot become 8-bit: {reason}")
    if paged and twin.paged is None:
        raise ValueError(f"paged=True is not allowed: {paged_refusal(optimizer)}; use paged=False.")
    groups = [_translate(twin.family, {k: v for k, v in g.items() if k not in _IMPLEMENTATION_KEYS}) for g in optimizer.param_groups]
    defaults = constructor_defaults(twin.family, optimizer.defaults, groups, twin.hyperparameters)
    cls = twin.paged if paged else twin.eight_bit
    if sharded:
        from lightning_efficient.optim.sharded import sharded_class

        cls = sharded_class(cls)
    built = cls(groups, **defaults, min_8bit_size=min_8bit_size)
    follow_torch_names(built)
    return built
