"""The random generators an object holds (a dataset's seeded augmentation), found and put back: reading a dataset's
samples before the fit (to compare the ranks' datasets, to measure a step) must not move the generator its augmentation
draws from, or the fit trains on other samples than plain Lightning's (a new user's seeded augmentation: weights 0.06
apart after 2 epochs)."""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import random
import types
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor

GENERATORS = (torch.Generator, np.random.Generator, np.random.RandomState, np.random.BitGenerator, random.Random)
_LEAVES = (Tensor, np.ndarray, str, bytes, bytearray, memoryview, int, float, complex, type(None), type, types.ModuleType,
           types.BuiltinFunctionType)
SEARCHED_OBJECTS = 4096  # objects looked into: a dataset that holds its samples is not walked whole
SEARCHED_ITEMS = 256  # items (or attributes) looked at in one container (or object)


def held_generators(root: Any) -> list[Any]:
    """The random generators ``root`` holds, found through its attributes, containers and code.

    Generators: ``torch.Generator``, NumPy's ``Generator``, ``RandomState`` and bit generators, ``random.Random`` but
    ``SystemRandom`` (which has no state). Looked into:

    - objects' attributes (read from their ``__dict__``, no properties or ``__getattr__`` run), looked into before the
      items of containers, so that a transform's generator is found beside wide per-sample records;
    - plain containers (``dict``, ``list``, ``tuple``, sets, ``deque``; not other mappings, which may read a file);
    - bound methods' objects, ``functools.partial``'s function and arguments, functions' closures and defaults;
    - the module-level generators of the code that reads a sample (the globals of a class's ``__getitem__``, of a
      function), not walked further.

    Up to :data:`SEARCHED_OBJECTS` objects and the first :data:`SEARCHED_ITEMS` items of each; whatever raises while
    being looked into (a dead weak proxy) is passed over.
    """
    found: dict[int, Any] = {}
    seen: dict[int, Any] = {}  # (held, so that no id is reused while walking)
    attributes, items = deque([root]), deque()
    while (attributes or items) and len(seen) < SEARCHED_OBJECTS:
        value = attributes.popleft() if attributes else items.popleft()
        try:
            if isinstance(value, _LEAVES) or id(value) in seen:
                continue
            seen[id(value)] = value
            if isinstance(value, GENERATORS):
                if not isinstance(value, random.SystemRandom):
                    found[id(value)] = value
                continue
            held_attributes, held_items, module_globals = _contents(value)
            attributes.extend(itertools.islice(held_attributes, SEARCHED_ITEMS))
            items.extend(itertools.islice(held_items, SEARCHED_ITEMS))
            for namespace in module_globals:
                if id(namespace) not in seen:
                    seen[id(namespace)] = namespace
                    found.update((id(v), v) for v in list(namespace.values())
                                 if isinstance(v, GENERATORS) and not isinstance(v, random.SystemRandom))
        except Exception:  # noqa: BLE001 - an object that cannot be looked into holds nothing found here
            continue
    return list(found.values())


def _contents(value: Any) -> tuple[list[Any], list[Any], list[dict]]:
    """What ``value`` holds: (attribute-like values, container items, module globals of the code it runs)."""
    if isinstance(value, dict):
        return [], list(itertools.islice(value.values(), SEARCHED_ITEMS)), []
    if isinstance(value, list | tuple | set | frozenset | deque):
        return [], list(itertools.islice(value, SEARCHED_ITEMS)), []
    if isinstance(value, functools.partial):
        return [value.func, *value.args, *value.keywords.values()], [], []
    if isinstance(value, types.MethodType):
        return [value.__self__, value.__func__], [], []
    if isinstance(value, types.FunctionType):
        cells = [cell.cell_contents for cell in value.__closure__ or () if _cell_filled(cell)]
        defaults = [*(value.__defaults__ or ()), *(value.__kwdefaults__ or {}).values()]
        return [*cells, *defaults], [], [value.__globals__]
    try:
        namespace = object.__getattribute__(value, "__dict__")
    except AttributeError:  # (slots only)
        namespace = None
    held = list(itertools.islice(namespace.values(), SEARCHED_ITEMS)) if isinstance(namespace, dict) else []
    reader = getattr(type(value), "__getitem__", None)  # (a dataset's: a module-level generator it draws from)
    return held, [], [reader.__globals__] if isinstance(reader, types.FunctionType) else []


def _cell_filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _generator_state(generator: Any) -> Any:
    if isinstance(generator, torch.Generator):
        return generator.get_state()
    if isinstance(generator, np.random.Generator):
        return copy.deepcopy(generator.bit_generator.state)
    if isinstance(generator, np.random.BitGenerator):
        return copy.deepcopy(generator.state)
    if isinstance(generator, np.random.RandomState):
        return generator.get_state()
    return generator.getstate()


def _set_generator_state(generator: Any, state: Any) -> None:
    if isinstance(generator, torch.Generator):
        generator.set_state(state)
    elif isinstance(generator, np.random.Generator):
        generator.bit_generator.state = state
    elif isinstance(generator, np.random.BitGenerator):
        generator.state = state
    elif isinstance(generator, np.random.RandomState):
        generator.set_state(state)
    else:
        generator.setstate(state)


@contextlib.contextmanager
def held_generators_restored(*roots: Any) -> Iterator[None]:
    """The random generators ``roots`` hold (:func:`held_generators`) put back afterwards. Other state a read changes (a
    read counter, a cache, a ``SeedSequence``'s count of children spawned) is the dataset's own."""
    generators = {id(generator): generator for root in roots for generator in held_generators(root)}
    states = [(generator, _generator_state(generator)) for generator in generators.values()]
    try:
        yield
    finally:
        for generator, state in states:
            _set_generator_state(generator, state)
