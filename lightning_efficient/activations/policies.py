"""Per-block activation policies, applied by wrapping a block's ``forward`` on the instance.

``keep`` leaves the block alone; ``checkpoint`` recomputes it in backward (non-reentrant
``torch.utils.checkpoint``, RNG state preserved, so dropout gives identical gradients; running statistics
of normalisation layers updated once, as without it);
``selective`` keeps the outputs of matmuls and attention and recomputes pointwise and normalisation
ops (torch's selective checkpoint API); ``offload`` and ``disk`` move the tensors the block saves
for backward to host memory or to files (see :mod:`lightning_efficient.activations.offload`).
Parameter names and ``state_dict`` keys are unchanged, and :func:`unwrap_block` restores the block.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_efficient._instance_wrappers import InstanceWrapper, put_back

POLICIES = ("keep", "checkpoint", "selective", "offload", "disk")

_aten = torch.ops.aten
# Outputs kept by `selective`: the matmuls and attention kernels, expensive to recompute.
SAVED_BY_SELECTIVE = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> tuple[Any, Any]:
    """The forward and recompute contexts of the ``selective`` policy."""
    return create_selective_checkpoint_contexts(_selective_policy)


def selective_refusal(block: nn.Module) -> str | None:
    """Why ``selective`` cannot recompute ``block`` exactly, or None where it can.

    A recurrent layer or cell changes its matmul outputs in place: a GRU's (``nn.GRU``, ``nn.GRUCell``) through views
    torch's mutation check does not follow, so ``selective`` kept them changed and the gradients came out wrong with no
    error (a new user's trial: weights 4e-4 away after one step; a review: a ``GRUCell`` loop 3.76 away); the others'
    (``nn.RNN``, ``nn.LSTM`` off oneDNN, their cells) stop the backward with torch's mutation error."""
    recurrent = next(((name, m) for name, m in block.named_modules() if isinstance(m, (nn.RNNBase, nn.RNNCellBase))), None)
    if recurrent is None:
        return None
    name, module = recurrent
    where = f"{type(block).__name__}.{name}" if name else type(block).__name__
    return (f"its recurrent layer {where} (nn.{type(module).__name__}) changes the matmul outputs 'selective' keeps in "
            "place (a GRU's unseen by torch: its gradients came out wrong, with no error)")


_MUTATED = "cached during selective activation checkpoint has been mutated"


def _reentrant_checkpoint(forward: Callable, args: tuple, kwargs: dict, block: nn.Module) -> Any:
    """Reentrant checkpointing of ``forward(*args, **kwargs)``.

    Reentrant checkpointing takes positional arguments only, and gives gradients only to tensors
    passed positionally at the top level; Hugging Face decoder layers take most of their inputs as
    keywords (``attention_mask``, ``position_embeddings`` as a tuple, ...). So every tensor found in
    ``args`` and ``kwargs`` (nested too) is passed positionally and put back in its place inside. Its
    outputs likewise: tensors in a dict, a ``ModelOutput`` or nested tuples are returned at the top level
    (torch's reentrant checkpoint returns the others untracked: no gradient reached the block) and put back.

    Raises:
        ValueError: where no tensor input requires grad but the block's parameters do (a frozen embedding
            below it): torch's reentrant checkpoint would give them no gradient, silently.
    """
    leaves, spec = tree_flatten((args, kwargs))
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
    if not any(leaves[i].requires_grad for i in where) and any(p.requires_grad for p in block.parameters()):
        raise ValueError(
            f"reentrant=True: the inputs of the checkpointed {type(block).__name__} require no grad, while its "
            "parameters do (a frozen layer below it): torch's reentrant checkpoint gives them no gradient then. "
            "Use reentrant=False (the default), or make an input require grad."
        )
    template = [None if isinstance(leaf, Tensor) else leaf for leaf in leaves]  # no second reference to the tensors
    outputs: dict[str, Any] = {}  # the structure of the block's output, as its forward (or its recomputation) returned it

    def run(*tensors: Tensor) -> tuple[Tensor, ...]:
        filled = list(template)
        for i, tensor in zip(where, tensors):
            filled[i] = tensor
        call_args, call_kwargs = tree_unflatten(filled, spec)
        out_leaves, out_spec = tree_flatten(forward(*call_args, **call_kwargs))
        out_where = [i for i, leaf in enumerate(out_leaves) if isinstance(leaf, Tensor)]
        if "where" not in outputs:  # the forward
            if not out_where and any(p.requires_grad for p in block.parameters()):
                raise ValueError(
                    f"reentrant=True: the checkpointed {type(block).__name__} returns no tensor torch's pytree can reach "
                    f"(its output is {type(out_leaves[0]).__name__ if out_leaves else 'empty'}): its parameters would get "
                    "no gradient. Use reentrant=False (the default)."
                )
            outputs.update(spec=out_spec, where=out_where, leaves=[None if isinstance(leaf, Tensor) else leaf for leaf in out_leaves])
        elif out_where != outputs["where"]:  # the recomputation in backward: its tensors must line up with the forward's
            raise RuntimeError(f"reentrant=True: the recomputed {type(block).__name__} returned its tensors in another "
                               "structure than its forward did")
        return tuple(out_leaves[i] for i in out_where)

    tensors = checkpoint(run, *(leaves[i] for i in where), use_reentrant=True, preserve_rng_state=True)
    filled = list(outputs["leaves"])
    for i, tensor in zip(outputs["where"], tensors):
        filled[i] = tensor
    return tree_unflatten(filled, outputs["spec"])


def _tracking_norms(block: nn.Module) -> list[nn.Module]:
    """The block's normalisation layers that track running statistics (BatchNorm's, InstanceNorm's with
    ``track_running_stats``)."""
    return [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats]


def _running_statistics(block: nn.Module) -> list[Tensor]:
    """The running statistics the block's normalisation layers update in training."""
    return [b for m in _tracking_norms(block) for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]


def _updates_running_statistics(block: nn.Module) -> bool:
    """Whether a forward of ``block`` now updates running statistics (a tracking layer in training mode; a frozen
    BatchNorm in eval mode updates none)."""
    return any(m.training for m in _tracking_norms(block))


def _recomputed_without_updates(forward: Callable, block: nn.Module) -> Callable:
    """``forward`` for one checkpointed call: the first run is the block's forward; a later one (the recomputation
    in backward) leaves the running statistics as the first left them, as a fit that keeps the block has them
    (torch's checkpoint runs a BatchNorm in training mode twice: two updates, ``num_batches_tracked`` counted
    twice)."""
    runs = 0

    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal runs
        runs += 1
        statistics = _running_statistics(block) if runs > 1 else []
        if not statistics:
            return forward(*args, **kwargs)
        # outside selective checkpointing's dispatch mode (its recomputation must see the forward's ops alone), and
        # through .data: batch_norm's backward holds the running statistics (unread in training), so an in-place
        # write counted on them would fail the backward
        with _disable_current_modes():
            saved = [t.detach().clone() for t in statistics]
        try:
            return forward(*args, **kwargs)
        finally:  # also where the recomputation stops early (torch raises to stop it)
            with _disable_current_modes(), torch.no_grad():
                for tensor, value in zip(statistics, saved):
                    tensor.data.copy_(value)

    return run


def _in_default_dtype(forward: Callable, dtype: torch.dtype) -> Callable:
    """``forward`` run under ``dtype`` as the default dtype, the one the block's forward saw: Lightning's ``bf16-true`` and
    ``64-true`` set it around the step's forward only, and the recomputation in backward ran under float32 (a new
    user's block that made its rotary frequencies with ``torch.arange(...) / d`` then failed in backward)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        previous = torch.get_default_dtype()
        if previous == dtype:
            return forward(*args, **kwargs)
        torch.set_default_dtype(dtype)
        try:
            return forward(*args, **kwargs)
        finally:
            torch.set_default_dtype(previous)

    return run


def _checkpointed(forward: Callable, selective: bool, reentrant: bool, block: nn.Module) -> Callable:
    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        # (only a block with running statistics needs the count of runs: a closure's count mutated inside the
        # checkpoint is a side effect that torch.compile refuses, running a compiled block eagerly, silently)
        once = _recomputed_without_updates(forward, block) if _updates_running_statistics(block) else forward
        if torch.get_default_dtype() != torch.float32:  # (bf16-true, 64-true: the default dtype is the forward's only)
            once = _in_default_dtype(once, torch.get_default_dtype())
        if reentrant and not selective:  # selective checkpointing exists only in the non-reentrant form
            return _reentrant_checkpoint(once, args, kwargs, block)
        if not selective:
            return checkpoint(once, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
        return checkpoint(_said_of_in_place_changes(once, block), *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=selective_context, **kwargs)

    return wrapped


def _said_of_in_place_changes(forward: Callable, block: nn.Module) -> Callable:
    """``forward``, whose recomputation under ``selective`` says which block an in-place op broke and what to do (torch's
    own error names neither: a new user's ``nn.ReLU(inplace=True)`` after a ``Linear``)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return forward(*args, **kwargs)
        except RuntimeError as error:
            if _MUTATED not in str(error):
                raise
            raise RuntimeError(
                f"ActivationMemory: policy 'selective' keeps the outputs of the matmuls in {type(block).__name__}, and an "
                "in-place op of its forward changed one (nn.ReLU(inplace=True), nn.Dropout(inplace=True), x.add_(...) "
                "after a Linear): use policy 'checkpoint' for this block (it recomputes the whole block, exactly), or "
                f"make the op out of place. ({error})"
            ) from error

    return run


def _within(forward: Callable, context: Callable[[], contextlib.AbstractContextManager]) -> Callable:
    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        with context():
            return forward(*args, **kwargs)

    return wrapped


def wrap_block(
    block: nn.Module,
    policy: str,
    *,
    hooks: Callable[[], contextlib.AbstractContextManager] | None = None,
    reentrant: bool = False,
) -> None:
    """Apply ``policy`` to ``block`` by replacing ``block.forward`` on the instance.

    Args:
        block: the module.
        policy: one of :data:`POLICIES`.
        hooks: for ``offload``/``disk``, a factory of the ``saved_tensors_hooks`` context to run in.
        reentrant: use reentrant checkpointing for ``checkpoint`` (not with DDP's find_unused_parameters);
            tensors passed as keywords, nested ones too, get their gradients as positional ones do.

    Raises:
        ValueError: for an unknown policy, offload/disk without ``hooks``, or ``selective`` on a block it cannot
            recompute exactly (:func:`selective_refusal`).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is not allowed: expected one of {', '.join(POLICIES)}.")
    if policy == "selective" and (reason := selective_refusal(block)) is not None:
        raise ValueError(f"policy='selective' is refused for {type(block).__name__}: {reason}. Use 'checkpoint' (exact).")
    unwrap_block(block)
    if policy == "keep":
        return
    forward = block.forward
    if policy in ("checkpoint", "selective"):
        wrapped = _checkpointed(forward, selective=policy == "selective", reentrant=reentrant, block=block)
    else:
        if hooks is None:
            raise ValueError(f"policy={policy!r} needs the saved-tensor hooks that move tensors off the device")
        wrapped = _within(forward, hooks)
    # (a copy of the block made while the fit runs gets its own forward, unwrapped)
    block.forward = InstanceWrapper(wrapped, forward)


def unwrap_block(block: nn.Module) -> None:
    """Restore the block's own ``forward`` (a no-op for an unwrapped block)."""
    wrapper = vars(block).get("forward")
    if isinstance(wrapper, InstanceWrapper):  # (a forward set on the instance before, someone else's wrapper, is kept)
        put_back(block, "forward", wrapper._original)


def policy_counts(policies: list[str]) -> str:
    """A plan's policies counted in the order they first appear (``"3 keep, 1 checkpoint"``; ``"none"`` for no block)."""
    return ", ".join(f"{policies.count(p)} {p}" for p in dict.fromkeys(policies)) or "none"
