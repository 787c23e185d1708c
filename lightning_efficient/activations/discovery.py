"""Finding the repeated blocks of a model (its transformer layers) without model edits."""

from __future__ import annotations

import fnmatch
from collections import Counter

from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_efficient._validation import SettingRefused
from lightning_efficient.memory import unsharded_class


def _is_composite(module: nn.Module) -> bool:
    """A module with parameters and sub-modules: a layer of a stack, not a bare ``Linear``."""
    return any(True for _ in module.parameters()) and any(True for _ in module.children())


def _block_containers(model: nn.Module) -> list[tuple[str, nn.Module, type | None]]:
    """``(name, container, child class)`` for every ModuleList/Sequential of >= 2 children of one class
    that hold parameters, but for those within a hybrid stack's layers. Where there is none, every hybrid stack: a
    ModuleList of >= 2 composite children of several classes, one of them repeated (attention and state-space layers,
    as Jamba's; child class None). A review: taken beside stacks of one class, wav2vec2's 7 feature-extractor
    convolutions (one GroupNorm layer, six without) beat its 2-6 transformer layers. Where there is neither, every
    ModuleList holding a single composite block (a one-layer model is still a stack of blocks). A block that FSDP2's
    ``fully_shard`` turned into ``FSDP<Name>`` counts as its own class ``<Name>``."""
    found, hybrid, single = [], [], []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        classes = {unsharded_class(c) for c in children}
        if not children or not any(True for _ in children[0].parameters()):
            continue
        if len(classes) > 1:
            if isinstance(module, nn.ModuleList) and len(children) > len(classes) and all(map(_is_composite, children)):
                hybrid.append((name, module, None))
            continue
        if len(children) >= 2:
            found.append((name, module, classes.pop()))
        elif isinstance(module, nn.ModuleList) and _is_composite(children[0]):
            single.append((name, module, classes.pop()))
    # a stack inside a hybrid stack's layers is those layers' own (transformers 4's Jamba: each MoE layer's experts)
    found = [c for c in found if not any(c[0].startswith(f"{name}.") for name, _, _ in hybrid)]
    return found or hybrid or single


def _trains(module: nn.Module) -> bool:
    """Whether a parameter of ``module`` requires a gradient."""
    return any(p.requires_grad for p in module.parameters())


def _warn_of_a_frozen_stack_beside_one_that_trains(chosen: list[tuple[str, nn.Module]],
                                                  containers: list[tuple[str, nn.Module, type | None]]) -> None:
    """Warn where the stacks taken hold no parameter that trains and another stack's do: a frozen teacher or reference
    model beside the student (a new user's distillation: the teacher's 4 layers, run under ``no_grad``, were taken
    over the student's 2, which nothing then checkpointed). Not decided for the user: a backbone frozen until a
    fine-tuning callback unfreezes it looks the same, and is the stack to take."""
    if any(_trains(container) for _, container in chosen):
        return
    trained = [name for name, container, _ in containers if _trains(container)]
    if trained:
        taken = ", ".join(f"{name}.*" for name, _ in chosen)
        rank_zero_warn(f"blocks='auto' took {taken} (the largest stack), no parameter of which trains, over "
                       f"{', '.join(f'{name}.*' for name in trained)}, which train: where the first runs under no_grad "
                       f"(a frozen teacher or reference model) it saves nothing to checkpoint; give "
                       f"blocks={[f'{name}.*' for name in trained]!r}")


def block_candidates(model: nn.Module) -> list[str]:
    """Class names of repeated modules and qualified names of their containers, for error messages."""
    return sorted(
        {cls.__name__ for _, _, cls in _block_containers(model) if cls is not None}
        | {f"{name}.*" for name, _, _ in _block_containers(model)}
    )


def find_blocks(model: nn.Module, blocks: str | list[str] = "auto") -> list[tuple[str, nn.Module]]:
    """The blocks whose forwards a policy wraps, as ``(qualified name, module)`` in forward order.

    Args:
        model: the model (a LightningModule or any ``nn.Module``).
        blocks: ``"auto"`` — the children of the largest ModuleList/Sequential whose children are all of
            one class (every such container of that largest size, so an encoder-decoder's two stacks
            are both found), or where there is none, of the largest hybrid stack of several classes (a warning
            where no parameter of theirs trains and another stack's does: a frozen teacher beside its student); or
            a list of class names (``"GPT2Block"``; a block sharded with FSDP2's ``fully_shard``, of class
            ``FSDPGPT2Block``, matches either name) and ``fnmatch`` patterns of qualified names
            (``"model.layers.*"``).

    Raises:
        SettingRefused: (a ValueError) when nothing matches, listing the candidates that exist.
    """
    if blocks == "auto":
        containers = _block_containers(model)
        if not containers:
            raise SettingRefused(
                "blocks='auto' found no ModuleList/Sequential of repeated blocks in "
                f"{type(model).__name__}; give class names or name patterns instead"
            )
        largest = max(len(c) for _, c, _ in containers)
        chosen = [(n, c) for n, c, _ in containers if len(c) == largest]
        # a container nested in another chosen block (a block's own repeated sub-layers) is not a block
        chosen = [(n, c) for n, c in chosen if not any(n != o and n.startswith(o + ".") for o, _ in chosen)]
        _warn_of_a_frozen_stack_beside_one_that_trains(chosen, containers)
        return [(f"{name}.{i}" if name else str(i), child) for name, c in chosen for i, child in enumerate(c.children())]
    if isinstance(blocks, str) or not blocks or not all(isinstance(b, str) for b in blocks):
        raise ValueError(f"blocks={blocks!r} is not allowed: expected 'auto' or a list of class names / name patterns")
    matched = [
        (name, module)
        for name, module in model.named_modules()
        if name and any(b in (type(module).__name__, unsharded_class(module).__name__) or fnmatch.fnmatchcase(name, b)
                        for b in blocks)
    ]
    # keep the outermost matches: wrapping a block and one of its sub-modules would recompute twice
    outermost = [(n, m) for n, m in matched if not any(n != o and n.startswith(o + ".") for o, _ in matched)]
    if not outermost:
        raise SettingRefused(f"blocks={blocks!r} matches no module; candidates: {', '.join(block_candidates(model)) or 'none'}")
    return outermost


def count_block_classes(blocks: list[tuple[str, nn.Module]]) -> dict[str, int]:
    """How many blocks of each class, for the plan printout."""
    return dict(Counter(unsharded_class(m).__name__ for _, m in blocks))


def transformers_checkpointing(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every module whose transformers gradient checkpointing is on (the
    ``gradient_checkpointing`` flag ``gradient_checkpointing_enable()`` sets) where it recomputes one of ``blocks``: a
    block, a module inside one, or a module holding one (older transformers read the flag in the layer loop)."""
    block_modules = [block for _, block in blocks]
    inside = {id(m) for block in block_modules for m in block.modules()}
    found = []
    for name, module in model.named_modules():
        if getattr(module, "gradient_checkpointing", None) is not True:
            continue
        if id(module) in inside or any(id(block) in {id(m) for m in module.modules()} for block in block_modules):
            found.append((name, module))
    return found
