"""One normalisation for data parallelism: by the global count of contributing tokens."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_efficient._distributed import waiting_for_other_ranks


def distributed_world_size() -> int:
    """The default process group's size (1 when torch.distributed is not initialised)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def global_sum(value: Tensor) -> Tensor:
    """``value`` summed over every rank (a copy; unchanged outside torch.distributed)."""
    total = value.detach().clone()
    if distributed_world_size() > 1:
        with waiting_for_other_ranks():
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def all_gather_variable(local: Tensor) -> Tensor:
    """Concatenate a 1-D tensor of any length from every rank (padded to the longest, then trimmed)."""
    world = distributed_world_size()
    if world == 1:
        return local
    count = torch.tensor([local.numel()], device=local.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    with waiting_for_other_ranks():
        dist.all_gather(counts, count)
        longest = int(max(c.item() for c in counts))
    padded = torch.zeros(longest, dtype=local.dtype, device=local.device)
    padded[: local.numel()] = local
    gathered = [torch.zeros_like(padded) for _ in range(world)]
    with waiting_for_other_ranks():
        dist.all_gather(gathered, padded)
    return torch.cat([g[: int(c.item())] for g, c in zip(gathered, counts)])


def global_kept_count(keep: Tensor, dtype: torch.dtype = torch.int64) -> Tensor:
    """Every rank's number of kept tokens, summed (at least 1, so that it can divide).

    The count is taken in int64 and returned in ``dtype``, which must hold it exactly: an integer
    type (the default int64, available on every backend) or float64. A half-precision count would be inf above 65,504 tokens
    (float16) or rounded above 256 (bfloat16).

    Raises:
        ValueError: for a ``dtype`` that cannot hold a token count exactly.
    """
    if dtype.is_floating_point and dtype != torch.float64:
        raise ValueError(f"dtype={dtype} is not allowed: expected torch.float64 or an integer dtype (exact counts).")
    return global_sum(keep.sum(dtype=torch.int64)).clamp_min(1).to(dtype)


def _loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least float32: token-loss sums and divisions never run in half precision."""
    return torch.promote_types(dtype, torch.float32)


def kept_loss_sum(token_losses: Tensor, keep: Tensor) -> Tensor:
    """The sum of the kept token losses, in float32 at least (half-precision sums lose tokens)."""
    losses = token_losses.to(_loss_dtype(token_losses.dtype))
    return torch.where(keep, losses, torch.zeros((), dtype=losses.dtype, device=losses.device)).sum()


def globally_normalised_loss(token_losses: Tensor, keep: Tensor, global_count: Tensor | None = None) -> Tensor:
    """Sum of the kept losses over the *global* number of kept tokens, times the world size.

    DDP averages gradients over ranks, so every rank's gradient of this loss averages to the
    gradient of (sum of every rank's kept losses) / (every rank's kept count): the update is the
    same however the tokens are split across ranks. ``global_count`` is that count when the caller
    has it already (:func:`global_kept_count`); otherwise it is all-reduced here. The sum and the
    division run in float32 at least (float16/bfloat16 losses give a float32 loss).

    This is one micro-batch's global mean: with gradient accumulation, use
    :class:`StepTokenNormaliser` to weight every token of the step alike.
    """
    kept_sum = kept_loss_sum(token_losses, keep)
    if global_count is None:
        global_count = global_kept_count(keep)
    factor = distributed_world_size() / global_count  # a float tensor of the default (float32) dtype
    return kept_sum * factor.to(kept_sum.dtype)


class _Shown(torch.autograd.Function):
    """Forward: ``value`` (in the dtype ``weighted`` and ``value`` promote to); backward: the gradient to ``weighted``
    as it comes."""

    @staticmethod
    def forward(ctx: Any, weighted: Tensor, value: Tensor) -> Tensor:
        ctx.dtype = weighted.dtype
        return value.to(torch.promote_types(weighted.dtype, value.dtype), copy=True)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad.to(ctx.dtype), None


def shown_as(weighted: Tensor, value: Tensor) -> Tensor:
    """A loss with ``weighted``'s gradient and ``value``'s value, exactly (an infinite one too): a micro-batch's loss
    weighted for its step (by a count that stands in for the step's until its last backward, a share of the global
    batch) is handed on by Lightning (``on_train_batch_end``'s ``outputs["loss"]``) as the micro-batch's own loss, the
    one a plain fit hands on (a trial: under FSDP2 the step after an epoch's short last step handed on 4 times the loss
    at 2 x 4). Its dtype is the two's promotion: float32 at least for a weighted token-loss sum, where a half-precision
    fit's own loss is in half precision. Not ``value + (weighted - weighted.detach())``, where an infinite weighted loss
    showed NaN."""
    if not weighted.requires_grad:
        return value.detach().to(torch.promote_types(weighted.dtype, value.dtype), copy=True)
    return _Shown.apply(weighted, value.detach())


def loss_weighted(output: Any, factor: float) -> Any:
    """``output`` (a loss tensor, or a mapping holding one under ``"loss"``) with its loss's gradient times ``factor``
    and its value as it was (:func:`shown_as`: what Lightning shows and hands on stays the micro-batch's own loss);
    any other output as it is."""
    if factor == 1.0:
        return output
    if isinstance(output, Tensor):
        return shown_as(output * factor, output)
    if isinstance(output, Mapping) and isinstance(output.get("loss"), Tensor):
        return {**output, "loss": shown_as(output["loss"] * factor, output["loss"])}
    return output


def _own_mean(local_sum: Tensor, local_count: Tensor | int) -> Tensor:
    """A micro-batch's own token mean (0 over no tokens)."""
    return local_sum.detach() / torch.as_tensor(local_count, device=local_sum.device).clamp_min(1)


def optimizer_step_normalising(original_optimizer_step: Callable[..., Any], normalise: Callable[[Any], None]) -> Callable[..., Any]:
    """A LightningModule's ``optimizer_step`` that runs ``normalise(optimizer)`` inside the optimizer closure, after the
    step's last backward: before AMP unscaling, ``on_before_optimizer_step`` hooks, gradient clipping and the optimizer."""

    def optimizer_step(epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> Any:
        if optimizer_closure is None:
            return original_optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

        def closure_then_normalise() -> Any:
            result = optimizer_closure()
            normalise(optimizer)
            return result

        return original_optimizer_step(epoch, batch_idx, optimizer, closure_then_normalise)

    return optimizer_step


class _NotesBackward:
    """Notes whether a backward went through a loss it watched (a step that runs none leaves the gradients alone)."""

    _backward_ran = False

    def _watched(self, loss: Tensor) -> Tensor:
        if loss.requires_grad:
            loss.register_hook(self._backward_through)
        return loss

    def _backward_through(self, grad: Tensor) -> Tensor:
        self._backward_ran = True
        return grad


class StepTokenNormaliser(_NotesBackward):
    """Makes a step's gradient the mean over every (kept) token of all its micro-batches and ranks.

    Lightning divides each micro-batch's loss by the accumulation ``A`` and DDP averages gradients
    over the ``W`` ranks, so a micro-batch loss that is its own (global) mean gives a mean of
    micro-batch means. Instead, each micro-batch contributes its local token-loss *sum* times
    ``W * A / K`` (:meth:`micro_batch_loss`), where ``K`` is a constant equal on every rank: the
    previous step's global token count (for the first step, the first micro-batch's global count
    times ``A``: one all-reduce). After the step's last backward, :meth:`normalise_gradients`
    all-reduces the step's local token counts once into ``T`` and multiplies the gradients by
    ``K / T``; then ``K := T``. The step's gradient is then (sum of every token's loss gradient) / T,
    the same as one big batch, also for a last step with fewer micro-batches than ``A``. With one
    micro-batch a step in one process, ``K`` is that micro-batch's own count, read then (``K = T``: the
    gradients are not touched again). Counts are
    int64 on the device (exact, and available on every backend); the host waits for the device once a
    step, for ``K / T``.

    Used by :class:`~lightning_efficient.tokens.SelectiveTokenLoss` and by the ``hetero_ddp`` strategy
    for :class:`~lightning_efficient.tokens.TokenLosses` without the callback, both from the optimizer
    closure: after the step's last backward, before AMP unscaling, ``on_before_optimizer_step``
    hooks, gradient clipping and the optimizer.
    """

    def __init__(self) -> None:
        self.scale: float | None = None  # K: the previous step's global token count
        self._known_non_finite: int | None = None  # the non-finite count of a step whose K was its own count (nothing to multiply)
        self.step_tokens: Tensor | None = None  # [tokens, non-finite losses] of this rank's micro-batches so far (int64)
        self._backward_ran = False  # whether a backward went through one of this step's losses

    def reset(self) -> None:
        """Forget ``K`` and any step in progress (a new fit starts from its first micro-batch's count)."""
        self.scale = None
        self.step_tokens = None
        self._known_non_finite = None
        self._backward_ran = False

    def begin_step(self) -> None:
        """Forget the tokens counted so far in this step (call it at a step's first micro-batch, so that
        a ``training_step`` run outside the loop is not counted)."""
        self.step_tokens = None
        self._known_non_finite = None
        self._backward_ran = False

    def micro_batch_loss(self, local_sum: Tensor, local_count: Tensor | int, accumulation: int,
                         non_finite: Tensor | int = 0, *, batch_idx: int | None = None, shown: Tensor | None = None) -> Tensor:
        """This micro-batch's loss: its local token-loss sum times ``W * A / K``, whose value is ``shown`` (by default
        the micro-batch's own token mean on this rank, :func:`shown_as`).

        Args:
            local_sum: the sum of this rank's (kept) token losses in the micro-batch.
            local_count: how many tokens that sum is over.
            accumulation: ``A``, the micro-batches per optimizer step Lightning divides by.
            non_finite: this rank's non-finite token losses in the micro-batch: counted with the
                tokens, so that :meth:`normalise_gradients` raises on every rank together instead of
                one rank raising while the others wait in a collective.
            batch_idx: the micro-batch's index in the epoch, where the caller runs in Lightning's loop: at a step's
                first micro-batch, what a call outside the loop (a profile) counted is forgotten (:meth:`begin_step`).
            shown: the value the loss shows (the module's own loss of the micro-batch, where it returned one).
        """
        if batch_idx is not None and batch_idx % accumulation == 0:
            self.begin_step()
        device = local_sum.device
        counts = torch.stack([torch.as_tensor(c, device=device).to(torch.int64).reshape(()) for c in (local_count, non_finite)])
        if accumulation == 1 and distributed_world_size() == 1:
            # one micro-batch a step in one process: the step's count is this micro-batch's, known now, so K := T
            # here and normalise_gradients has no pass over the gradients to make (the step's one host sync moves here)
            tokens, non_finite_count = counts.tolist()
            self.scale, self.step_tokens, self._known_non_finite = float(max(tokens, 1)), None, int(non_finite_count)
            weighted = local_sum.to(_loss_dtype(local_sum.dtype)) / self.scale  # (the own mean already)
            return weighted if shown is None else shown_as(weighted, shown)
        if self.scale is None:  # the first step: one all-reduce (and one host sync) estimates the step's count
            self.scale = float(max(int(global_sum(counts[:1])) * accumulation, 1))
        self.step_tokens = counts if self.step_tokens is None else self.step_tokens + counts
        local_sum = local_sum.to(_loss_dtype(local_sum.dtype))
        loss = local_sum * (distributed_world_size() * accumulation / self.scale)
        return shown_as(self._watched(loss), _own_mean(local_sum, local_count) if shown is None else shown)

    def normalise_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Multiply the optimizer's gradients by ``K / T`` (``T``: the step's global token count), then
        ``K := T``. Call it on every rank after the step's last backward; nothing to do when no
        micro-batch went through :meth:`micro_batch_loss` since the last call, and the gradients are left as they
        are when no backward went through those micro-batches' losses (a step that skips it).

        Raises:
            FloatingPointError: on every rank, when any rank had non-finite token losses this step.
        """
        known, self._known_non_finite = self._known_non_finite, None
        if known:
            raise FloatingPointError(f"{known} per-token losses are not finite in this step; they are not dropped silently.")
        if self.step_tokens is None:
            return
        tokens, non_finite = (int(c) for c in global_sum(self.step_tokens))  # one host sync a step
        self.step_tokens = None
        backward_ran, self._backward_ran = self._backward_ran, False
        if non_finite:
            raise FloatingPointError(f"{non_finite} per-token losses over all ranks are not finite in this step; "
                                     "they are not dropped silently.")
        total = max(tokens, 1)
        factor, self.scale = self.scale / total, float(total)
        if factor == 1.0:
            return
        # (where no backward ran this step, StochasticWeightAveraging's batch-norm epoch, the gradients held, if any, are
        # an earlier step's, which plain Lightning's optimizer steps with as they are)
        if backward_ran:
            _multiply_gradients([optimizer], factor)


class RankStepTokenMean(_NotesBackward):
    """Makes each rank's step gradient the mean over that rank's valid tokens in all the step's micro-batches, where a
    rank's gradients are its own until the step's last backward (one process; Lightning's DDP, which does not
    synchronise the accumulating micro-batches): DDP then averages the ranks' means, as a plain DDP fit does with one
    batch a step, so that splitting the batch does not change the update.

    A step's micro-batches before its last contribute their token-loss sum times ``A / K`` (``A``: the accumulation
    Lightning divides by; ``K``: a stand-in for the step's count, this rank's previous step's count per micro-batch
    times ``A``, or at a fit's first step its first micro-batch's count times ``A``). At the last, before its backward,
    this rank's count ``T`` is
    known: the gradients held are multiplied by ``K / T`` and the last micro-batch contributes its sum times
    ``A / T``. ``K`` sets only the gradients' scale before the last backward, so the previous step's count (which a
    step's seldom strays far from) is taken over a first micro-batch's (a padded row of one valid token made an
    fp16 GradScaler skip steps). Counts stay on the device (the host waits for them only where a checkpoint saves
    :attr:`previous_count`), no collective is added; a resume without that count starts from the first micro-batch's,
    which changes nothing but rounding. Non-finite losses pass on as in plain Lightning.
    """

    def __init__(self) -> None:
        self._step: tuple[Tensor, Tensor, int] | None = None  # (tokens, K, micro-batches) of this rank's step so far
        self._previous: Tensor | None = None  # this rank's previous step's count per micro-batch (times A: the next K)
        self._backward_ran = False  # whether a backward went through one of this step's losses before the last

    def reset(self) -> None:
        """Forget any step in progress and the previous step's count (a new fit)."""
        self.forget_step()
        self._previous = None

    @property
    def previous_count(self) -> float | None:
        """This rank's previous step's token count per micro-batch (the next step's stand-in; None before a step), to
        save in a checkpoint: a resume that starts from it rounds as the uninterrupted run."""
        return None if self._previous is None else float(self._previous)

    @previous_count.setter
    def previous_count(self, count: float | None) -> None:
        self._previous = None if count is None else torch.tensor(count, dtype=torch.float32)

    def forget_step(self) -> None:
        """Forget the step in progress (a step's first micro-batch that returned no token losses)."""
        self._step = None
        self._backward_ran = False

    def micro_batch_loss(self, local_sum: Tensor, local_count: Tensor | int, accumulation: int, *, first: bool, last: bool,
                         optimizers: Iterable[torch.optim.Optimizer], shown: Tensor | None = None) -> Tensor:
        """This micro-batch's loss (see the class docstring), whose value is ``shown`` (by default the micro-batch's own
        token mean, :func:`shown_as`).

        Args:
            local_sum: the sum of this rank's token losses in the micro-batch.
            local_count: how many tokens that sum is over.
            accumulation: ``A``, the micro-batches per optimizer step Lightning divides by.
            first: whether the micro-batch is its step's first (what is counted is forgotten).
            last: whether it is its step's last (the one whose backward synchronises the ranks' gradients).
            optimizers: the optimizers whose gradients the step's earlier micro-batches accumulated.
            shown: the value the loss shows (the module's own loss of the micro-batch, where it returned one).
        """
        shown = _own_mean(local_sum, local_count) if shown is None else shown
        device = local_sum.device
        local_sum = local_sum.to(_loss_dtype(local_sum.dtype))
        count = torch.as_tensor(local_count, device=device).to(torch.int64).reshape(())
        if first or self._step is None:
            per_micro_batch = self._previous.to(device) if self._previous is not None else count.clamp_min(1).to(torch.float32)
            self._step = (count, (per_micro_batch * accumulation).to(local_sum.dtype), 1)
            self._backward_ran = False
        else:
            self._step = (self._step[0] + count, self._step[1], self._step[2] + 1)
        if last:
            total = self._close(optimizers).to(local_sum.dtype)
            return shown_as(local_sum * (accumulation / total), shown)
        loss = local_sum * (accumulation / self._step[1])
        return shown_as(self._watched(loss), shown)

    def close_step(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Close a step whose last micro-batch did not come through :meth:`micro_batch_loss` (its ``training_step``
        returned None, or no token losses): the gradients its earlier micro-batches hold become the mean over their
        tokens, the tokens that trained (left so, they kept the stand-in's scale: half the mean at 2 micro-batches a
        step with the first's count standing in). Call it after the step's last backward; nothing to do where the
        step's last micro-batch closed it."""
        if self._step is not None:
            self._close(optimizers)

    def _close(self, optimizers: Iterable[torch.optim.Optimizer]) -> Tensor:
        """End the step in progress: the gradients its earlier backwards hold are multiplied by ``K / T``; ``T`` (at
        least 1) is returned and, per micro-batch, kept as the next step's stand-in."""
        tokens, scale, micro_batches = self._step
        backward_ran = self._backward_ran
        self.forget_step()
        total = tokens.clamp_min(1)
        # per micro-batch: an epoch's short last step, or another accumulation next, keeps the scale
        self._previous = total.to(torch.float32) / micro_batches  # (float32: every device has it)
        if backward_ran:  # (else nothing of this step is held: a first micro-batch, or a step no backward ran in)
            _multiply_gradients(optimizers, scale / total.to(scale.dtype))
        return total


def _multiply_gradients(optimizers: Iterable[torch.optim.Optimizer], factor: Tensor | float) -> None:
    """Multiply every gradient the optimizers hold by ``factor`` (a number, or a 0-dim tensor, cast once for each
    device and dtype): one fused multiply per device and dtype, DTensor gradients (FSDP2) one at a time."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    groups.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    for (device, dtype), grads in groups.items():
        cast = factor.to(device=device, dtype=dtype) if isinstance(factor, Tensor) else factor
        plain = [g for g in grads if type(g) is Tensor]
        if plain:
            torch._foreach_mul_(plain, cast)
        for grad in grads:
            if type(grad) is not Tensor:
                grad.mul_(cast)
