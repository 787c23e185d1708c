"""lightning_efficient._generators: the random generators a dataset, its collate function and the code reading a sample
hold are found and put back, and nothing a dataset holds makes the search fail."""

import functools
import gc
import random
import weakref

import numpy as np
import torch

from lightning_efficient._generators import held_generators, held_generators_restored

MODULE_LEVEL = np.random.default_rng(11)  # a module-level generator a dataset's __getitem__ draws from


class _Aug:
    def __init__(self, generator) -> None:
        self.generator = generator


class _Wide(torch.utils.data.Dataset):
    """Wide per-sample records (COCO-like metadata) beside a transform holding a generator (a review: the search's cap
    was spent on the records' values, and the transform's generator was missed)."""

    def __init__(self) -> None:
        self.records = [{f"column_{c}": [c, str(c), float(c)] for c in range(70)} for _ in range(500)]
        self.transform = [_Aug(torch.Generator().manual_seed(1))]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> float:
        return float(torch.rand((), generator=self.transform[0].generator)) + MODULE_LEVEL.random()


class _Raising:
    """Slots only, with a __getattr__ that raises something other than AttributeError."""

    __slots__ = ("inner",)

    def __getattr__(self, name):
        raise RuntimeError(f"no {name}")


JITTER = torch.Generator().manual_seed(12)  # a module-level generator a transform's __call__ draws from


class _Jitter:
    def __call__(self, x):
        return x + torch.rand((), generator=JITTER)


class _ClassHeld:
    shared = np.random.default_rng(13)  # a generator held by the class


class _Slotted:
    __slots__ = ("generator",)

    def __init__(self) -> None:
        self.generator = random.Random(14)


class _Collator:
    def __init__(self) -> None:
        self.generator = np.random.default_rng(3)

    def collate(self, samples):
        return torch.tensor(samples) + self.generator.random()


def test_generators_are_found_through_attributes_containers_code_and_module_globals():
    closed_over = random.Random(5)
    bit_generator = np.random.PCG64(6)
    partial_generator = torch.Generator().manual_seed(7)

    def closure(samples):
        return closed_over.random()

    class Holder:
        pass

    dead = Holder()
    proxy = weakref.proxy(dead)
    del dead
    gc.collect()
    dataset, collator = _Wide(), _Collator()
    dataset.extras = {"proxy": proxy, "raising": _Raising(), "bits": bit_generator, "system": random.SystemRandom()}
    roots = (dataset, collator.collate, functools.partial(closure, generator=partial_generator), closure)
    found = {id(g) for root in roots for g in held_generators(root)}
    expected = [dataset.transform[0].generator, MODULE_LEVEL, bit_generator, collator.generator, partial_generator, closed_over]
    assert all(id(g) in found for g in expected), [type(g).__name__ for g in expected if id(g) not in found]
    assert not any(isinstance(g, random.SystemRandom) for root in roots for g in held_generators(root))
    # (a review) a transform's __call__ drawing from its module's generator, a class attribute, slots, a C method's object
    c_method = random.Random(15).random
    for root, generator in ((_Jitter(), JITTER), (_ClassHeld(), _ClassHeld.shared), (_Slotted(), None), ([c_method], c_method.__self__)):
        generator = generator if generator is not None else root.generator
        assert any(g is generator for g in held_generators(root)), type(root).__name__

    states = (dataset.transform[0].generator.get_state(), MODULE_LEVEL.bit_generator.state, bit_generator.state,
              collator.generator.bit_generator.state, partial_generator.get_state(), closed_over.getstate())
    with held_generators_restored(*roots):
        [dataset[i] for i in range(3)]
        collator.collate([1.0, 2.0]), closure([]), bit_generator.random_raw(4)
        torch.rand(2, generator=partial_generator)
    assert torch.equal(dataset.transform[0].generator.get_state(), states[0]) and MODULE_LEVEL.bit_generator.state == states[1]
    assert bit_generator.state == states[2] and collator.generator.bit_generator.state == states[3]
    assert torch.equal(partial_generator.get_state(), states[4]) and closed_over.getstate() == states[5]
