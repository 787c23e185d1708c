"""Small helpers that turn a bad constructor argument into a ValueError naming it."""

from __future__ import annotations

from typing import Any


class SettingRefused(ValueError):
    """A setting this run cannot take, found before the first step (by the fit's ranks, DataLoader or batch, not by the
    constructor): the message names the setting, its value and what this run allows. The command line says it in one
    line."""


def _not_allowed(name: str, value: Any, allowed: str) -> str:
    return f"{name}={value!r} is not allowed: expected {allowed}."


def refuse_unless(condition: bool, who: str, name: str, value: Any, allowed: str) -> None:
    """Raise :class:`SettingRefused` (``who``: the class refusing) naming the setting, its value and what this run
    allows, unless ``condition``."""
    if not condition:
        raise SettingRefused(f"{who}: {_not_allowed(name, value, allowed)}")


def require(condition: bool, name: str, value: Any, allowed: str) -> None:
    """Raise a ValueError naming ``name``, its ``value`` and what is ``allowed`` unless ``condition``.

    Args:
        condition: the check that must hold.
        name: the argument's name as the user wrote it.
        value: the value the user gave.
        allowed: a short phrase saying what is accepted, e.g. ``"an integer >= 1"``.

    Raises:
        ValueError: when ``condition`` is false.
    """
    if not condition:
        raise ValueError(_not_allowed(name, value, allowed))


def require_choice(name: str, value: Any, choices: tuple[str, ...] | list[str]) -> None:
    """Raise a ValueError unless ``value`` is one of ``choices``."""
    require(value in choices, name, value, "one of " + ", ".join(repr(c) for c in choices))


def require_int(name: str, value: Any, minimum: int) -> None:
    """Raise a ValueError unless ``value`` is an int (not a bool) at least ``minimum``."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    require(ok, name, value, f"an integer >= {minimum}")


def require_bool(name: str, value: Any) -> None:
    """Raise a ValueError unless ``value`` is True or False (a string like ``"no"`` is truthy)."""
    require(isinstance(value, bool), name, value, "True or False")


def require_path(name: str, value: Any) -> None:
    """Raise a ValueError unless ``value`` is None or a path string (``str`` or ``os.PathLike``)."""
    import os

    require(value is None or isinstance(value, (str, os.PathLike)), name, value, "None or a path")
