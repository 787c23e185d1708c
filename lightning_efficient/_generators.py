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
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

GENERATORS = (torch.Generator, np.random.Generator, np.random.RandomState, np.random.BitGenerator, random.Random)
_LEAVES = (Tensor, np.ndarray, str, bytes, bytearray, memoryview, int, float, complex, type(None), type, types.ModuleType)
SEARCHED_OBJECTS = 4096  # objects looked into: a dataset that holds its samples is not walked whole
SEARCHED_ITEMS = 256  # items (or attributes) looked at in one container (or object)


def held_generators(root: Any) -> list[Any]:
    """The random generators ``root`` holds, found through its attributes, containers and code.

    Generators: ``torch.Generator``, NumPy's ``Generator``, ``RandomState`` and bit generators, ``random.Random`` but
    ``SystemRandom`` (which has no state). Looked into:

    - objects' attributes (read from their ``__dict__``, no properties or ``__getattr__`` run), looked into before the
      items of containers, so that a transform's generator is found beside wide per-sample records;
    - plain containers (``dict``, ``list``, ``tuple``, sets, ``deque``; not other mappings, which may read a file);
    - ``__slots__``, bound methods' objects (also a C method's: ``random.Random(0).random``), ``functools.partial``'s
      function and arguments, functions' closures and defaults;
    - the generators a class holds as attributes, and the module-level generators of the code an object or a function
      runs (the globals of each function of its class and bases: a transform's ``__call__`` drawing from its module's
      generator), not walked further.

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
            if _is_generator(value):
                found[id(value)] = value
                continue
            held_attributes, held_items, namespaces = _contents(value)
            attributes.extend(itertools.islice(held_attributes, SEARCHED_ITEMS))
            items.extend(itertools.islice(held_items, SEARCHED_ITEMS))
            for owner, namespace in namespaces:  # module globals and class attributes: their generators, not walked further
                if id(owner) not in seen:
                    seen[id(owner)] = owner
                    found.update((id(v), v) for v in list(namespace.values()) if _is_generator(v))
        except Exception:  # noqa: BLE001 - an object that cannot be looked into holds nothing found here
            continue
    return list(found.values())


def _is_generator(value: Any) -> bool:
    try:
        return isinstance(value, GENERATORS) and not isinstance(value, random.SystemRandom)
    except Exception:  # noqa: BLE001 - (a dead weak proxy among a module's globals)
        return False


def _contents(value: Any) -> tuple[list[Any], list[Any], list[tuple[Any, Mapping]]]:
    """What ``value`` holds: (attribute-like values, container items, (owner, namespace) pairs whose generators count:
    module globals of the code it runs, its class's attributes)."""
    if isinstance(value, dict):
        return [], list(itertools.islice(value.values(), SEARCHED_ITEMS)), []
    if isinstance(value, list | tuple | set | frozenset | deque):
        return [], list(itertools.islice(value, SEARCHED_ITEMS)), []
    if isinstance(value, functools.partial):
        return [value.func, *value.args, *value.keywords.values()], [], []
    if isinstance(value, types.MethodType | types.BuiltinMethodType):  # (a generator's own C method: its __self__)
        return [value.__self__, getattr(value, "__func__", None)], [], []
    if isinstance(value, types.FunctionType):
        cells = [cell.cell_contents for cell in value.__closure__ or () if _cell_filled(cell)]
        defaults = [*(value.__defaults__ or ()), *(value.__kwdefaults__ or {}).values()]
        return [*cells, *defaults], [], [(value.__globals__, value.__globals__)]
    held: list[Any] = []
    try:
        namespace = object.__getattribute__(value, "__dict__")
    except AttributeError:  # (slots only)
        namespace = None
    if isinstance(namespace, dict):
        held += itertools.islice(namespace.values(), SEARCHED_ITEMS)
    return held + _slot_values(value), [], _class_namespaces(type(value))


def _slot_values(value: Any) -> list[Any]:
    """The values of ``value``'s ``__slots__`` (read raw, as its ``__dict__`` is)."""
    names = [name for cls in type(value).__mro__ for name in _slot_names(cls)]
    values = []
    for name in names[:SEARCHED_ITEMS]:
        try:
            values.append(object.__getattribute__(value, name))
        except AttributeError:  # (not set)
            continue
    return values


def _slot_names(cls: type) -> list[str]:
    slots = cls.__dict__.get("__slots__", ())
    return [slots] if isinstance(slots, str) else [name for name in slots if name not in ("__dict__", "__weakref__")]


def _class_namespaces(cls: type) -> list[tuple[Any, Mapping]]:
    """The class attributes of ``cls`` and its bases (a generator held by the class), and the module globals of their
    functions (a transform's ``__call__`` drawing from its module's generator), but builtins' (``object``'s)."""
    namespaces: list[tuple[Any, Mapping]] = []
    for base in cls.__mro__:
        if base.__module__ == "builtins":
            continue
        attributes = vars(base)
        namespaces.append((base, attributes))
        for attribute in list(attributes.values()):
            function = getattr(attribute, "__func__", attribute)  # (classmethod, staticmethod)
            if isinstance(function, types.FunctionType):
                namespaces.append((function.__globals__, function.__globals__))
    return namespaces


def _cell_filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _set_bit_generator_state(generator: Any, state: Any) -> None:
    generator.bit_generator.state = state


def _set_state_attribute(generator: Any, state: Any) -> None:
    generator.state = state


# each kind of generator: how its state is read and written back (RandomState's legacy form warns for bit generators
# other than MT19937)
_STATE_ACCESS: tuple[tuple[type, Callable[[Any], Any], Callable[[Any, Any], None]], ...] = (
    (torch.Generator, lambda g: g.get_state(), lambda g, s: g.set_state(s)),
    (np.random.Generator, lambda g: copy.deepcopy(g.bit_generator.state), _set_bit_generator_state),
    (np.random.BitGenerator, lambda g: copy.deepcopy(g.state), _set_state_attribute),
    (np.random.RandomState, lambda g: g.get_state(legacy=False), lambda g, s: g.set_state(s)),
    (random.Random, lambda g: g.getstate(), lambda g, s: g.setstate(s)),
)


def _state_access(generator: Any) -> tuple[Callable[[Any], Any], Callable[[Any, Any], None]]:
    return next((read, write) for kind, read, write in _STATE_ACCESS if isinstance(generator, kind))


@contextlib.contextmanager
def held_generators_restored(*roots: Any) -> Iterator[None]:
    """The random generators ``roots`` hold (:func:`held_generators`) put back afterwards. Other state a read changes (a
    read counter, a cache, a ``SeedSequence``'s count of children spawned) is the dataset's own."""
    generators = {id(generator): generator for root in roots for generator in held_generators(root)}
    saved = []
    for generator in generators.values():
        read, write = _state_access(generator)
        saved.append((generator, write, read(generator)))
    try:
        yield
    finally:
        for generator, write, state in saved:
            write(generator, state)
