"""``EightBitOptimizer``: the bitsandbytes 8-bit twin of whatever optimizer the module built."""

from __future__ import annotations

import fnmatch
import inspect
import itertools
import weakref
from collections.abc import Callable
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_efficient._validation import require, require_bool, require_choice, require_int
from lightning_efficient.optim._bnb import bitsandbytes
from lightning_efficient.optim.offload import host_offloaded, repaged_on_load, share_quantization_maps
from lightning_efficient.optim.schedulers import rebind_schedulers
from lightning_efficient.optim.sharded import (
    checkpoint_layouts,
    has_sharded_params,
    install_layout_hooks,
    quantized_state_names,
    shard_mesh,
)
from lightning_efficient.optim.state import (
    BNB_BLOCKWISE,
    TORCH_32BIT,
    convert_optimizer_state,
    param_state_layout,
)
from lightning_efficient.optim.twins import (
    NoTwinError,
    build_twin,
    constructor_defaults,
    eight_bit_classes,
    family_of,
    find_twin,
    follow_torch_names,
    is_stateless,
    paged_refusal,
)
from lightning_efficient.optim.unsynced import unsynced


def _flat_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


#: for each optimizer that held no states before its fit, the 8-bit twin that trained in its place, with the states
#: that fit left: a ``configure_optimizers`` that keeps the optimizer between fits gets them back in its next fit's twin,
#: as plain Lightning's next fit goes on from a kept optimizer's states. Keyed weakly: an optimizer built afresh for
#: every fit leaves nothing behind once it is dropped.
_TWINS_LEFT: weakref.WeakKeyDictionary[torch.optim.Optimizer, torch.optim.Optimizer] = weakref.WeakKeyDictionary()


def _left_states_with_groups_of(left: torch.optim.Optimizer, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``left``'s ``state_dict`` with ``optimizer``'s hyperparameters (its param groups as they are now) in place of
    ``left``'s, for ``optimizer`` to load."""
    saved = left.state_dict()
    saved["param_groups"] = [{**group, "params": old["params"]}
                             for group, old in zip(optimizer.state_dict()["param_groups"], saved["param_groups"])]
    return saved


class EightBitOptimizer(Callback):
    """Replaces every optimizer the module (or the LightningCLI) built with its bitsandbytes 8-bit twin.

    Same param groups and hyperparameters, passed by keyword. Every learning-rate scheduler that
    steps the replaced optimizer is re-bound to the new one, including the schedulers inside
    ``SequentialLR`` and ``ChainedScheduler`` at any depth, so every scheduled hyperparameter (``lr``,
    and the ``momentum``/``betas`` of ``OneCycleLR`` and ``CyclicLR``) reaches the 8-bit optimizer at
    every step, exactly as it would reach the module's own optimizer.

    Parameters with fewer than ``min_8bit_size`` elements, embedding weights (unless
    ``embeddings_32bit=False``) and parameters whose names match ``keep_32bit`` keep 32-bit states,
    through bitsandbytes' ``GlobalOptimManager.override_config``. What was converted is printed at the
    start of fit and given to :class:`MemoryReport`. bitsandbytes is imported at the start of fit,
    not when this package is.

    Checkpoints resume exactly. A checkpoint whose Adam/AdamW states are in the other layout is
    converted on load with a warning: a 32-bit checkpoint's moments are quantized for the 8-bit
    optimizer, and with ``bits=32`` (keep the module's own 32-bit optimizer) an 8-bit checkpoint's
    moments are dequantized, so a run can switch mid-way. The bitsandbytes version, the state
    layout and the settings that say which parameters were 8-bit (``min_8bit_size``, ``keep_32bit``,
    ``embeddings_32bit``: a sharded resume into 32-bit reads them) are recorded in the checkpoint.

    Under FSDP2 (Lightning's ``ModelParallelStrategy``; parameters are DTensors) bitsandbytes steps
    each rank's local shard and a rank holds about 2.05 bytes of state per *local* parameter
    (:mod:`lightning_efficient.optim.sharded`). Lightning's distributed (sharded) checkpoint and its
    full-state checkpoint both resume exactly on the same device mesh, and convert between 32-bit
    and 8-bit shard by shard; an 8-bit checkpoint saved on another device mesh (or without sharding)
    is refused before the first step. ``offload="cpu"`` is refused with sharded parameters: FSDP2's
    own ``CPUOffloadPolicy`` keeps parameters, gradients and these states on the host.

    Args:
        min_8bit_size: tensors with fewer elements keep 32-bit states (>= 1; bitsandbytes' default 4096).
        keep_32bit: ``fnmatch`` patterns of parameter names that keep 32-bit states.
        embeddings_32bit: keep the weights of ``nn.Embedding`` modules (and what is tied to them) 32-bit.
        paged: use bitsandbytes' paged optimizers (CUDA; warns once and is ignored on CPU); states loaded
            from a checkpoint are paged again. bitsandbytes has paged twins for Adam, AdamW and Lion only:
            for SGD, RMSprop or Adagrad fit raises ``ValueError``.
        offload: ``"cpu"`` keeps the 8-bit states in host memory between steps, copied in and out per
            parameter with the next one prefetched and the copies back overlapping the next updates
            (CUDA; warns once and is ignored on CPU); or None.
        strict: raise for an optimizer with no 8-bit twin; with False, leave it as it is and warn.
        bits: 8 to convert; 32 to keep the module's optimizers and only dequantize 8-bit checkpoint states.

    Raises:
        ValueError: naming the argument for an invalid setting.
    """

    def __init__(
        self,
        min_8bit_size: int = 4096,
        keep_32bit: list[str] | None = None,
        embeddings_32bit: bool = True,
        paged: bool = False,
        offload: Literal["cpu"] | None = None,
        strict: bool = True,
        bits: Literal[8, 32] = 8,
    ) -> None:
        require_int("min_8bit_size", min_8bit_size, 1)
        require(keep_32bit is None or (isinstance(keep_32bit, (list, tuple)) and all(isinstance(p, str) for p in keep_32bit)),
                "keep_32bit", keep_32bit, "a list of name patterns (not a single string)")
        require_bool("embeddings_32bit", embeddings_32bit)
        require_bool("paged", paged)
        require_bool("strict", strict)
        if offload is not None:
            require_choice("offload", offload, ("cpu",))
        require(not (paged and offload), "offload", offload, "None when paged=True (paged states already move to the host)")
        require(type(bits) is int and bits in (8, 32), "bits", bits, "the int 8 or 32")
        self.min_8bit_size = min_8bit_size
        self.keep_32bit = list(keep_32bit or [])
        self.embeddings_32bit = embeddings_32bit
        self.paged = paged
        self.offload = offload
        self.strict = strict
        self.bits = bits
        self._overridden: set[int] = set()
        self._loaded_checkpoint: dict | None = None
        self._figures: dict[str, int] = {}
        self._device_mesh: list[int] | None = None
        self._patched_strategy: Any = None
        # (the user's optimizer, its twin, whether the twin holds the states the user's held before the fit, the keys of
        # the twin's own settings in its groups, the schedulers re-bound to it) for every twin of this fit: the user's
        # schedulers step the user's optimizer again after it; carried states are cleared from the user's when training
        # starts (they are the twin's then) and written back after the fit
        self._twins: list[tuple[torch.optim.Optimizer, torch.optim.Optimizer, bool, set[str], list[Any]]] = []
        self._held_cleared = False

    # -- which parameters stay 32-bit -------------------------------------------------------
    def _kept_32bit(self, pl_module: LightningModule, keep_32bit: list[str] | None = None,
                    embeddings_32bit: bool | None = None) -> dict[int, str]:
        """Why each parameter keeping 32-bit states does (by ``id``), under this callback's settings or those given
        (a checkpoint's: then patterns that match nothing are not refused)."""
        own = keep_32bit is None and embeddings_32bit is None
        keep_32bit = self.keep_32bit if keep_32bit is None else keep_32bit
        embeddings_32bit = self.embeddings_32bit if embeddings_32bit is None else embeddings_32bit
        reasons: dict[int, str] = {}
        if embeddings_32bit:
            for module in pl_module.modules():
                if isinstance(module, nn.Embedding):
                    reasons[id(module.weight)] = "embedding"
        matched = False
        for name, param in pl_module.named_parameters():
            if any(fnmatch.fnmatch(name, pattern) for pattern in keep_32bit):
                matched = True  # also when the parameter is 32-bit already for another reason (an embedding)
                reasons.setdefault(id(param), "pattern")
        if own and keep_32bit and not matched:
            names = [n for n, _ in pl_module.named_parameters()][:10]
            raise ValueError(f"keep_32bit={keep_32bit!r} matches no parameter name; names look like {names}")
        return reasons

    def holds_8bit_states(self, optimizers: list[torch.optim.Optimizer], pl_module: LightningModule) -> bool:
        """Whether the twins of ``optimizers`` would hold any state in 8 bits under these settings (every parameter
        below ``min_8bit_size``, an embedding kept 32-bit or matched by ``keep_32bit``: they would not)."""
        kept = self._kept_32bit(pl_module)
        return any(param.numel() >= self.min_8bit_size and id(param) not in kept
                   for optimizer in optimizers if not (isinstance(optimizer, eight_bit_classes()) or is_stateless(optimizer))
                   for param in _flat_params(optimizer))

    def _uses_8bit(self, param: torch.Tensor) -> bool:
        return param.numel() >= self.min_8bit_size and id(param) not in self._overridden

    # -- conversion ---------------------------------------------------------------------------
    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        on_cuda = pl_module.device.type == "cuda"
        self._device_mesh = shard_mesh(list(pl_module.parameters()))
        if self._device_mesh is not None and self.bits == 8 and self.offload:
            raise ValueError(
                f"offload={self.offload!r} is not allowed with sharded (DTensor) parameters: use None, and FSDP2's own "
                "fully_shard(..., offload_policy=CPUOffloadPolicy()) to keep parameters, gradients and optimizer states "
                "on the host (the optimizer then steps there)."
            )
        if self.bits == 8 and not on_cuda and (self.paged or self.offload):
            rank_zero_warn("EightBitOptimizer: paged/offload need a CUDA device; on CPU the optimizer runs as plain 8-bit.")
        if self.bits == 8:
            self._convert_optimizers(trainer, pl_module, paged=self.paged and on_cuda, offload=bool(self.offload) and on_cuda)
        else:
            self._dequantize_left_states(trainer)
        if self._loaded_checkpoint is not None:  # restored before setup (one device, DDP)
            layouts = [{param_state_layout(s) for s in o["state"].values()} - {None}
                       for o in self._loaded_checkpoint.get("optimizer_states", [])]
            self._check_saved_mesh(layouts, self._loaded_checkpoint.get("callbacks"))
        elif self._device_mesh is not None and not trainer.strategy.lightning_restore_optimizer:
            self._intercept_sharded_load(trainer, pl_module)
        self._convert_loaded_states(trainer)

    def _convert_optimizers(self, trainer: Trainer, pl_module: LightningModule, paged: bool, offload: bool) -> None:
        reasons = self._kept_32bit(pl_module)
        replaced = self.build_twins(trainer.strategy.optimizers, pl_module, paged=paged, offload=offload, reasons=reasons)
        for index, (optimizer, twin) in enumerate(zip(trainer.strategy.optimizers, replaced)):
            if twin is not optimizer:
                schedulers = [config.scheduler for config in trainer.strategy.lr_scheduler_configs]
                rebind_schedulers(schedulers, optimizer, twin)
                # read before the held states load into the twin, which takes their groups' keys
                own = ({key for group in twin.param_groups for key in group} | set(twin.defaults)) - {
                    key for group in optimizer.param_groups for key in group}
                # a configure_optimizers that keeps one optimizer between fits: its 32-bit states are in the twin now
                # (quantized), not held twice once training starts; they come back into it, updated, after the fit
                carried = self._carry_held_states(optimizer, twin, index, resuming=trainer.ckpt_path is not None)
                self._twins.append((optimizer, twin, carried, own, schedulers))
        trainer.strategy.optimizers = replaced
        self._report(trainer, reasons)

    def build_twins(
        self, optimizers: list[torch.optim.Optimizer], pl_module: LightningModule, *, paged: bool, offload: bool,
        reasons: dict[int, str] | None = None,
    ) -> list[torch.optim.Optimizer]:
        """Each optimizer's 8-bit twin under this callback's settings (the optimizer itself where it stays
        as it is), with the 32-bit overrides registered in bitsandbytes (dropped at teardown, or by
        :meth:`drop_overrides`); schedulers are not touched.

        Raises:
            ValueError: for ``paged=True`` on an optimizer without a paged twin.
            NoTwinError: for an optimizer without a twin under ``strict=True``.
        """
        reasons = self._kept_32bit(pl_module) if reasons is None else reasons
        manager = bitsandbytes().optim.GlobalOptimManager.get_instance()
        replaced: list[torch.optim.Optimizer] = []
        for index, optimizer in enumerate(optimizers):
            if isinstance(optimizer, eight_bit_classes()) or is_stateless(optimizer):
                replaced.append(optimizer)
                continue
            if find_twin(optimizer) is None and not self.strict:
                rank_zero_warn(f"EightBitOptimizer: optimizer {index} ({type(optimizer).__name__}) has no 8-bit twin; left as it is.")
                replaced.append(optimizer)
                continue
            if self.paged and paged_refusal(optimizer):  # refused on CPU too, where paging is off anyway
                raise ValueError(f"paged=True is not allowed for optimizer {index}: {paged_refusal(optimizer)}; use paged=False.")
            try:
                twin = build_twin(optimizer, min_8bit_size=self.min_8bit_size, paged=paged, sharded=has_sharded_params(optimizer))
            except NoTwinError as error:
                if self.strict:
                    raise NoTwinError(f"{error} (EightBitOptimizer(strict=False) leaves such an optimizer as it is, with a "
                                      "warning)") from None
                rank_zero_warn(f"EightBitOptimizer: optimizer {index}: {error}; left as it is.")
                replaced.append(optimizer)
                continue
            # registered only once the twin exists: bitsandbytes reads them when a state is first made. Every parameter
            # of the module the settings keep 32-bit, not only the optimizer's now: one added to it while the fit runs
            # (BaseFinetuning's unfrozen layers) gets its state then, and bitsandbytes finds its override by its id
            for param in [*_flat_params(optimizer), *pl_module.parameters()]:
                if id(param) in reasons and id(param) not in self._overridden:
                    manager.override_config(param, "optim_bits", 32)
                    self._overridden.add(id(param))
            if offload:
                twin = self._offloaded(twin)
            elif paged:
                twin = self._rebuilt(twin, repaged_on_load(type(twin)))  # still paged after a resume
            else:
                twin = self._rebuilt(twin, unsynced(type(twin)))  # no device wait after every parameter
            replaced.append(twin)
        return replaced

    def _carry_held_states(self, optimizer: torch.optim.Optimizer, twin: torch.optim.Optimizer, index: int, *,
                           resuming: bool = False) -> bool:
        """Load into ``twin`` (no state yet) the states ``optimizer`` held before the fit (a ``configure_optimizers``
        that keeps one optimizer between fits), quantized as a 32-bit checkpoint's are on resume; whether it did. A
        twin of an optimizer whose states do not convert (not torch's Adam layout, or sharded) starts without them,
        as said. An optimizer holding none gets the 8-bit states its twin left in the fit before, if any (not carried:
        they stay 8-bit, in the twin), but not on a resume (``resuming``: the checkpoint's states are loaded next)."""
        left = _TWINS_LEFT.pop(optimizer, None)
        if not len(optimizer.state):
            if left is not None and not resuming:
                self._resume_left_states(left, optimizer, twin, index)
            return False
        layouts = {param_state_layout(state) for state in optimizer.state.values()} - {None}
        why, converted = None, None
        if layouts != {TORCH_32BIT}:  # bitsandbytes' own 32-bit optimizers: states in its layout
            why = f"in layout {', '.join(sorted(layouts))}"
        elif has_sharded_params(optimizer):
            why = "of sharded (DTensor) parameters"
        else:
            try:
                converted, _ = convert_optimizer_state(optimizer.state_dict(), _flat_params(optimizer), BNB_BLOCKWISE, self._uses_8bit)
            except ValueError as error:
                why = f"({error})"
        if converted is None:
            rank_zero_warn(f"EightBitOptimizer: optimizer {index} ({type(optimizer).__name__}) holds states from before "
                           f"this fit that do not convert to 8-bit here {why}; its 8-bit twin starts without them.")
            return False
        twin.load_state_dict(converted)
        return True

    def _resume_left_states(self, left: torch.optim.Optimizer, optimizer: torch.optim.Optimizer, twin: torch.optim.Optimizer,
                            index: int) -> None:
        """Load into ``twin`` the states ``left``, the twin of ``optimizer``'s fit before (:data:`_TWINS_LEFT`), left, in
        their 8-bit layout as they were, with ``twin``'s own hyperparameters (the user's param groups now). Where the
        parameters changed, or which of them are 8-bit (other ``min_8bit_size``, ``keep_32bit``, ``embeddings_32bit``),
        the twin starts without them, as said."""
        params = _flat_params(twin)
        why = None
        if len(params) != len(_flat_params(left)) or any(a is not b for a, b in zip(params, _flat_params(left))):
            why = "its parameters changed"
        elif any((state["state1"].dtype == torch.uint8) != self._uses_8bit(param)
                 for param, state in left.state.items() if "state1" in state):
            why = "other parameters are 8-bit under this callback's settings"
        else:
            try:
                twin.load_state_dict(_left_states_with_groups_of(left, twin))
            except ValueError as error:  # the groups changed between the fits
                twin.state.clear()
                why = f"{error}"
        if why is not None:
            rank_zero_warn(f"EightBitOptimizer: optimizer {index} ({type(optimizer).__name__}) was kept from the fit before, "
                           f"but the 8-bit states that fit left do not load into this fit's twin ({why}); it starts "
                           "without them.")

    @staticmethod
    def forget_left_states(optimizer: torch.optim.Optimizer) -> None:
        """Drop the 8-bit states the last fit's twin of ``optimizer`` left for a next fit (a kept optimizer's, see the
        README): the next 8-bit fit starts it afresh, as clearing ``optimizer.state`` does not (it holds none of them)."""
        _TWINS_LEFT.pop(optimizer, None)

    def _dequantize_left_states(self, trainer: Trainer) -> None:
        """``bits=32``: a kept optimizer holding no states takes the ones its 8-bit twin left in the fit before, dequantized
        (as an 8-bit checkpoint's are), so a run can switch mid-way; not on a resume (the checkpoint's come next)."""
        for index, optimizer in enumerate(trainer.strategy.optimizers):
            left = _TWINS_LEFT.pop(optimizer, None)
            if left is None or len(optimizer.state) or not len(left.state) or trainer.ckpt_path is not None:
                continue
            try:
                if any(a is not b for a, b in itertools.zip_longest(_flat_params(optimizer), _flat_params(left))):
                    raise ValueError("its parameters changed")
                converted, count = convert_optimizer_state(_left_states_with_groups_of(left, optimizer), _flat_params(optimizer),
                                                           TORCH_32BIT)
                optimizer.load_state_dict(converted)
            except ValueError as error:
                optimizer.state.clear()
                rank_zero_warn(f"EightBitOptimizer(bits=32): the 8-bit states optimizer {index} ({type(optimizer).__name__}) "
                               f"was left by the fit before do not convert ({error}); it starts without them.")
                continue
            rank_zero_warn(f"EightBitOptimizer(bits=32): optimizer {index} ({type(optimizer).__name__}) goes on from the "
                           f"8-bit states the fit before left, {count} of them dequantized.")

    def _hand_back_to_user(self, trainer: Trainer) -> None:
        """Every scheduler back on the user's optimizer, which takes the hyperparameters the fit left in its twin's
        param groups; and the twins' states, dequantized, into the user's
        optimizers that held states before the fit (as plain Lightning's fit leaves them updated in the optimizer
        the module keeps), which take the twins' places in the strategy (its teardown moves their states as plain
        Lightning's does). Before training started, the user's states are still theirs, untouched."""
        cleared, self._held_cleared = self._held_cleared, False
        twins, self._twins = self._twins, []
        configs = trainer.strategy.lr_scheduler_configs
        for optimizer, twin, carried, twins_own_keys, schedulers in twins:
            # a scheduler the module keeps between fits (Lightning refuses one left on the twin), also one a callback
            # took out of the trainer's during the fit (StochasticWeightAveraging puts its SWALR in its place)
            rebind_schedulers([*schedulers, *(config.scheduler for config in configs)], twin, optimizer)
            # the hyperparameters the fit's schedulers set (lr, momentum, betas), as plain Lightning leaves them, with keys
            # callbacks added to the twin's groups during the fit (StochasticWeightAveraging's swa_lr), and the groups they
            # added (BaseFinetuning's unfrozen layers); not the twin's own settings (SGD8bit's betas)
            for position, twin_group in enumerate(twin.param_groups):
                values = {key: value for key, value in twin_group.items() if key not in twins_own_keys and key != "params"}
                if position < len(optimizer.param_groups):
                    optimizer.param_groups[position].update(values)
                else:
                    optimizer.add_param_group({"params": twin_group["params"], **values})
            index = next((i for i, o in enumerate(trainer.strategy.optimizers) if o is twin), None)
            # for a next fit that gets this optimizer again (not one still holding states of its own: they are its)
            if not carried and len(twin.state) and not len(optimizer.state) and not has_sharded_params(optimizer):
                _TWINS_LEFT[optimizer] = twin
            if not carried or index is None:
                continue
            trainer.strategy.optimizers = [optimizer if o is twin else o for o in trainer.strategy.optimizers]
            if not cleared:
                continue
            try:
                converted, _ = convert_optimizer_state(twin.state_dict(), _flat_params(optimizer), TORCH_32BIT)
                # (with the groups' keys as above: the twin's state dict carries its own settings too)
                converted["param_groups"] = [{key: value for key, value in group.items() if key not in twins_own_keys}
                                             for group in converted["param_groups"]]
                optimizer.load_state_dict(converted)
            except Exception as error:  # noqa: BLE001 - the fit's own outcome stands; the user learns what is lost
                rank_zero_warn(f"EightBitOptimizer: the 8-bit states of optimizer {index} ({type(optimizer).__name__}) "
                               f"could not be written back into it after the fit ({type(error).__name__}: {error}); it "
                               "holds no states now.")

    def _offloaded(self, twin: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``twin`` rebuilt as its host-offloaded class, same param groups.

        Only the keyword arguments ``type(twin)``'s constructor accepts are passed: ``twin.defaults``
        also holds keys its constructor refuses (``alpha`` for AdamW8bit, ``betas`` for SGD8bit).
        """
        return self._rebuilt(twin, host_offloaded(type(twin)))

    def _rebuilt(self, twin: torch.optim.Optimizer, cls: type) -> torch.optim.Optimizer:
        """``twin`` (no state yet) rebuilt as ``cls``, a subclass of its class, same param groups."""
        accepted = set(inspect.signature(type(twin).__init__).parameters) - {"self", "params", "args", "min_8bit_size"}
        groups = twin.param_groups
        rebuilt = cls(groups, **constructor_defaults(family_of(twin), twin.defaults, groups, accepted), min_8bit_size=self.min_8bit_size)
        follow_torch_names(rebuilt)
        return rebuilt

    def _report(self, trainer: Trainer, reasons: dict[int, str]) -> None:
        counts = {"8bit": [0, 0], "32bit_small": [0, 0], "32bit_embedding": [0, 0], "32bit_pattern": [0, 0]}
        for optimizer in trainer.strategy.optimizers:
            if not isinstance(optimizer, eight_bit_classes()):
                continue
            for param in _flat_params(optimizer):
                if id(param) in reasons:
                    key = f"32bit_{reasons[id(param)]}"
                elif param.numel() < self.min_8bit_size:
                    key = "32bit_small"
                else:
                    key = "8bit"
                counts[key][0] += 1
                counts[key][1] += param.numel()
        self._figures = {f"optimizer_{k}_params": n for k, (_, n) in counts.items()}
        lines = [f"  {k:<16} {t:>5} tensors {n:>12,} parameters" for k, (t, n) in counts.items()]
        rank_zero_info("EightBitOptimizer: optimizer states by precision\n" + "\n".join(lines))

    # -- checkpoints --------------------------------------------------------------------------
    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning moves every loaded optimizer state to the device after load_state_dict: offloaded
        # and paged states go back where they belong before the first forward
        for optimizer in trainer.optimizers:
            share_quantization_maps(optimizer)  # a loaded state holds a copy of them per parameter
            settle = getattr(optimizer, "settle_loaded_states", None)
            if callable(settle):
                settle()
        carried = [optimizer for optimizer, _, held, _, _ in self._twins if held]
        for optimizer in carried:  # the twin holds them now (a resume: the checkpoint's)
            optimizer.state.clear()
        self._held_cleared = bool(carried)

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # Lightning loads the optimizer states from this same dict after on_fit_start, once the
        # optimizers are replaced: they are converted there, against the new optimizers' parameters.
        # ModelParallelStrategy loads them itself, after on_fit_start (see _prepare_sharded_resume).
        if trainer.strategy.lightning_restore_optimizer:
            self._loaded_checkpoint = checkpoint

    def _check_saved_mesh(self, layouts: list[set[str]], callbacks: dict | None) -> None:
        """Refuse 8-bit states saved sharded over another device mesh (or saved unsharded, resumed sharded)."""
        if not any(BNB_BLOCKWISE in found for found in layouts):
            return
        saved = (callbacks or {}).get(self.state_key, {})
        saved_mesh = saved.get("device_mesh") if isinstance(saved, dict) else None
        if saved_mesh == self._device_mesh:
            return
        where = lambda mesh: f"sharded over a device mesh of shape {mesh}" if mesh else "without sharding"
        raise ValueError(
            f"EightBitOptimizer: the checkpoint's 8-bit optimizer states were saved {where(saved_mesh)}, this run is "
            f"{where(self._device_mesh)}: bitsandbytes quantizes each rank's shard in its own blocks of 256, which do not "
            "line up on another layout. Resume on the layout that saved it, or save a 32-bit checkpoint there "
            "(EightBitOptimizer(bits=32) resumed from it, one step) and convert from that."
        )

    def _intercept_sharded_load(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Run :meth:`_prepare_sharded_resume` when the strategy loads a checkpoint (after ``on_fit_start``).

        ``ModelParallelStrategy`` restores after ``on_fit_start`` and the checkpoint's path reaches only
        its ``load_checkpoint``: that method is wrapped on the instance, for its next call only (and put
        back in ``teardown``/``on_exception`` if it is never called).
        """
        strategy = trainer.strategy
        original = strategy.load_checkpoint

        def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
            self._restore_strategy()
            self._prepare_sharded_resume(trainer, pl_module, checkpoint_path)
            return original(checkpoint_path, *args, **kwargs)

        strategy.load_checkpoint = load_checkpoint
        self._patched_strategy = strategy

    def _restore_strategy(self) -> None:
        strategy, self._patched_strategy = self._patched_strategy, None
        if strategy is not None and "load_checkpoint" in vars(strategy):
            del strategy.load_checkpoint

    def _prepare_sharded_resume(self, trainer: Trainer, pl_module: LightningModule, path: Any) -> None:
        """Before a checkpoint is restored: check its layout and make the optimizers' templates match it.

        ``ModelParallelStrategy`` loads optimizer states through ``torch.distributed.checkpoint`` into
        the template each optimizer's ``state_dict`` gives: for a checkpoint in the other layout (32-bit
        for the 8-bit twin, 8-bit for ``bits=32``) the template is given in that layout and the loaded
        states are converted per local shard.
        """
        layouts, group_keys, callbacks = checkpoint_layouts(path)
        self._check_saved_mesh(layouts, callbacks)
        # which parameters the saving run held 8-bit: read from the checkpoint's keys where they name every parameter;
        # else by the settings it recorded (checkpoints from before they were: by this callback's own)
        saved = (callbacks or {}).get(self.state_key)
        saved = saved if isinstance(saved, dict) else {}
        min_8bit_size = int(saved.get("min_8bit_size", self.min_8bit_size))
        kept = self._kept_32bit(pl_module, list(saved.get("keep_32bit", self.keep_32bit)),
                                bool(saved.get("embeddings_32bit", self.embeddings_32bit)))
        names = {id(param): name for name, param in pl_module.named_parameters()}
        by_name = quantized_state_names(path) if any(BNB_BLOCKWISE in found for found in layouts) else {}

        def was_8bit_in(optimizer: torch.optim.Optimizer, index: int) -> Callable[[torch.Tensor], bool]:
            stated, quantized = by_name.get(index, (set(), set()))
            if all(names.get(id(p)) in stated for p in _flat_params(optimizer)):
                return lambda param: names[id(param)] in quantized
            return lambda param: param.numel() >= min_8bit_size and id(param) not in kept

        for index, (optimizer, found, groups) in enumerate(zip(trainer.strategy.optimizers, layouts, group_keys)):
            if not has_sharded_params(optimizer) or not found:
                continue
            if isinstance(optimizer, eight_bit_classes()):
                other = TORCH_32BIT
                if TORCH_32BIT in found:
                    optimizer.saved_layout, optimizer.saved_group_keys = TORCH_32BIT, groups
                if BNB_BLOCKWISE in found:
                    self._refuse_other_8bit_parameters(optimizer, index, was_8bit_in(optimizer, index), names, saved)
            else:
                other = BNB_BLOCKWISE
                expect = install_layout_hooks(optimizer, was_8bit_in(optimizer, index))
                if BNB_BLOCKWISE in found:
                    expect(BNB_BLOCKWISE, groups)
            if other in found:
                rank_zero_warn(
                    f"EightBitOptimizer: optimizer {index}'s checkpoint holds {other} states; they are converted to "
                    f"{BNB_BLOCKWISE if other == TORCH_32BIT else TORCH_32BIT} shard by shard as they load, to keep training."
                )

    def _refuse_other_8bit_parameters(self, twin: torch.optim.Optimizer, index: int, was_8bit: Callable[[torch.Tensor], bool],
                                      names: dict[int, str], saved: dict[str, Any]) -> None:
        """Refuse a sharded 8-bit checkpoint whose parameters were 8-bit where ``twin``'s are not (or the other way):
        loaded into the twin's template, 8-bit codes would land in 32-bit states (silently) or be missing."""
        differ = [(names.get(id(p), "?"), was_8bit(p)) for p in _flat_params(twin) if was_8bit(p) != twin._eight_bit(p)]
        if not differ:
            return
        shown = ", ".join(f"{name} ({'8-bit' if then else '32-bit'} in the checkpoint)" for name, then in differ[:5])
        recorded = {k: saved[k] for k in ("min_8bit_size", "keep_32bit", "embeddings_32bit") if k in saved}
        raise ValueError(
            f"EightBitOptimizer: optimizer {index}'s checkpoint holds {len(differ)} parameter(s) in another state "
            f"precision than this run gives them: {shown}. Resume with the saving run's settings"
            f"{f' ({recorded})' if recorded else ''} (this run: min_8bit_size={self.min_8bit_size}, "
            f"keep_32bit={self.keep_32bit}, embeddings_32bit={self.embeddings_32bit}); to change them, resume once "
            "with EightBitOptimizer(bits=32) (dequantized), save, and resume from that checkpoint."
        )

    def _convert_loaded_states(self, trainer: Trainer) -> None:
        if self._loaded_checkpoint is None:
            return
        states = self._loaded_checkpoint.get("optimizer_states", [])
        for index, (optimizer, state) in enumerate(zip(trainer.strategy.optimizers, states)):
            target = BNB_BLOCKWISE if isinstance(optimizer, eight_bit_classes()) else TORCH_32BIT
            layouts = {param_state_layout(s) for s in state["state"].values()} - {None}
            if not layouts or layouts == {target}:
                continue
            converted, count = convert_optimizer_state(state, _flat_params(optimizer), target, self._uses_8bit)
            states[index] = converted
            rank_zero_warn(
                f"EightBitOptimizer: optimizer {index}'s checkpoint holds {', '.join(sorted(layouts))} states; "
                f"converted {count} of them to {target} ({'quantized' if target == BNB_BLOCKWISE else 'dequantized'}) "
                "to keep training."
            )
        self._loaded_checkpoint = None

    @override
    def state_dict(self) -> dict[str, Any]:
        # with the settings that say which parameters were 8-bit: a sharded resume needs them before it loads the states
        return {"bitsandbytes_version": bitsandbytes().__version__, "bits": self.bits, "layout": BNB_BLOCKWISE if self.bits == 8 else TORCH_32BIT,
                "device_mesh": self._device_mesh, "min_8bit_size": self.min_8bit_size, "keep_32bit": list(self.keep_32bit),
                "embeddings_32bit": self.embeddings_32bit}

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.drop_overrides()
        self._restore_strategy()
        self._hand_back_to_user(trainer)
        self._loaded_checkpoint = None  # a fit that ended before on_fit_start (a plan-only fit) leaves it

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # Lightning skips callbacks' teardown when fit raises
        self.drop_overrides()
        self._restore_strategy()
        self._hand_back_to_user(trainer)  # the steps taken before the failure, as plain Lightning's optimizer holds them
        self._loaded_checkpoint = None

    def drop_overrides(self) -> None:
        """Remove our 32-bit overrides from bitsandbytes' process-wide manager.

        bitsandbytes keys them by ``id(param)``; one left behind would silently make a later
        parameter that reuses the id keep 32-bit states, in any 8-bit optimizer of the process.
        """
        if not self._overridden:
            return
        manager = bitsandbytes().optim.GlobalOptimManager.get_instance()
        for key in self._overridden:
            manager.pid2config.pop(key, None)
        self._overridden.clear()

    def memory_figures(self) -> dict[str, int]:
        """Parameter counts by state precision, for :class:`MemoryReport`."""
        return dict(self._figures)
