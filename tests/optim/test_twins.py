import bitsandbytes as bnb
import pytest
import torch

from lightning_efficient.memory import optimizer_state_bytes
from lightning_efficient.optim import NoTwinError, build_twin


def _params():
    return [torch.nn.Parameter(torch.randn(128, 64)), torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(7))]


def _groups(params, **second):
    return [{"params": params[:1]}, {"params": params[1:], **second}]


CASES = [
    (torch.optim.AdamW, {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-7, "weight_decay": 0.2}, {"lr": 1e-3, "weight_decay": 0.0}, bnb.optim.AdamW8bit),
    (torch.optim.Adam, {"lr": 3e-3, "betas": (0.85, 0.9), "eps": 1e-6}, {"betas": (0.7, 0.8)}, bnb.optim.Adam8bit),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3}, {"momentum": 0.5}, bnb.optim.SGD8bit),
    (torch.optim.RMSprop, {"lr": 0.01, "alpha": 0.95, "eps": 1e-6, "weight_decay": 1e-4}, {"alpha": 0.9}, bnb.optim.RMSprop8bit),
    (torch.optim.Adagrad, {"lr": 0.05, "eps": 1e-9, "weight_decay": 1e-3}, {"lr": 0.02}, bnb.optim.Adagrad8bit),
    (bnb.optim.Lion, {"lr": 1e-4, "betas": (0.95, 0.98), "weight_decay": 0.1}, {"lr": 5e-5}, bnb.optim.Lion8bit),
]


@pytest.mark.parametrize(("cls", "kwargs", "second", "twin_cls"), CASES, ids=[c[0].__name__ for c in CASES])
def test_every_hyperparameter_of_every_group_is_carried(cls, kwargs, second, twin_cls):
    params = _params()
    original = cls(_groups(params, **second), **kwargs)
    twin = build_twin(original, min_8bit_size=4096, paged=False)
    assert type(twin) is twin_cls
    for old, new in zip(original.param_groups, twin.param_groups):
        assert new["params"] == old["params"]
        for key, value in old.items():
            if key in ("params", "foreach", "fused", "capturable", "differentiable", "maximize", "amsgrad", "decoupled_weight_decay"):
                continue
            assert new[key] == value, key
        if cls is torch.optim.SGD:
            assert new["betas"] == (old["momentum"], old["dampening"])
        if cls is torch.optim.RMSprop:
            assert new["betas"][0] == old["alpha"]


def test_twin_of_8bit_twins_update_like_bitsandbytes_directly():
    params = _params()
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = build_twin(torch.optim.AdamW(_groups(params, lr=1e-3), lr=3e-3, weight_decay=0.1), min_8bit_size=4096, paged=False)
    direct = bnb.optim.AdamW8bit([{"params": clones[:1]}, {"params": clones[1:], "lr": 1e-3}], lr=3e-3, weight_decay=0.1)
    for _step in range(5):
        grads = [torch.randn_like(p, generator=None) for p in params]
        for p, c, g in zip(params, clones, grads):
            p.grad, c.grad = g.clone(), g.clone()
        ours.step()
        direct.step()
    for p, c in zip(params, clones):
        assert torch.equal(p, c)


@pytest.mark.parametrize(
    ("optimizer", "pattern"),
    [
        (lambda p: torch.optim.AdamW(p, amsgrad=True), "amsgrad=True"),
        (lambda p: torch.optim.Adam(p, weight_decay=0.1), "L2 penalty"),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True), "nesterov=True"),
        (lambda p: torch.optim.RMSprop(p, centered=True), "centered=True"),
        (lambda p: torch.optim.Adagrad(p, lr_decay=0.1), "lr_decay=0.1"),
        (lambda p: torch.optim.Adadelta(p), "torch.optim.adadelta.Adadelta has no bitsandbytes 8-bit twin; supported: .*AdamW"),
    ],
)
def test_settings_the_twin_cannot_honour_are_refused(optimizer, pattern):
    with pytest.raises(NoTwinError, match=pattern):
        build_twin(optimizer(_params()), min_8bit_size=4096, paged=False)


def test_eight_bit_state_bytes_per_parameter():
    big = torch.nn.Parameter(torch.randn(1024, 1024))
    optimizer = build_twin(torch.optim.AdamW([big]), min_8bit_size=4096, paged=False)
    big.grad = torch.randn_like(big)
    optimizer.step()
    per_param = optimizer_state_bytes(optimizer) / big.numel()
    assert per_param <= 2.05
    assert per_param == (2 * big.numel() + 2 * 4 * big.numel() // 256 + 2 * 1024) / big.numel()


OFFLOAD_CASES = [
    (torch.optim.AdamW, {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-7, "weight_decay": 0.2}),
    (torch.optim.Adam, {"lr": 3e-3, "betas": (0.85, 0.9), "eps": 1e-6}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3}),
    (torch.optim.RMSprop, {"lr": 0.01, "alpha": 0.95, "eps": 1e-6, "weight_decay": 1e-4}),
    (torch.optim.Adagrad, {"lr": 0.05, "eps": 1e-9, "weight_decay": 1e-3}),
    (bnb.optim.Lion, {"lr": 1e-4, "betas": (0.95, 0.98), "weight_decay": 0.1}),
]


@pytest.mark.parametrize(("cls", "kwargs"), OFFLOAD_CASES, ids=[c[0].__name__ for c in OFFLOAD_CASES])
def test_offload_cpu_builds_the_host_offloaded_twin_and_it_steps_like_the_twin(cls, kwargs):
    from lightning_efficient import EightBitOptimizer
    from lightning_efficient.optim.offload import host_offloaded

    params = _params()
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    plain = build_twin(cls(_groups(params, lr=kwargs["lr"] / 2), **kwargs), min_8bit_size=4096, paged=False)
    # what EightBitOptimizer(offload="cpu") does with a twin at fit start (on CUDA)
    offloaded = EightBitOptimizer(offload="cpu")._offloaded(
        build_twin(cls(_groups(clones, lr=kwargs["lr"] / 2), **kwargs), min_8bit_size=4096, paged=False)
    )
    assert type(offloaded) is host_offloaded(type(plain))
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        if step == 2:  # as a scheduler would: every scheduled key reaches the offloaded twin's update
            for optimizer in (plain, offloaded):
                for group in optimizer.param_groups:
                    group["lr"] *= 0.5
                    if "momentum" in group:
                        group["momentum"] = 0.6
        for p, c in zip(params, clones):
            p.grad = torch.randn(p.shape, generator=g)
            c.grad = p.grad.clone()
        plain.step()
        offloaded.step()
    for p, c in zip(params, clones):
        assert torch.equal(p, c)


def test_a_scheduled_sgd_momentum_is_the_momentum_bitsandbytes_uses():
    params = _params()
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = build_twin(torch.optim.SGD(params, lr=0.1, momentum=0.9), min_8bit_size=4096, paged=False)
    direct = bnb.optim.SGD8bit(clones, lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        if step == 2:
            twin.param_groups[0]["momentum"] = 0.5  # what OneCycleLR/CyclicLR write into an SGD group
            direct.param_groups[0]["betas"] = (0.5, 0.0)  # what bitsandbytes reads
        for p, c in zip(params, clones):
            p.grad = torch.randn(p.shape, generator=g)
            c.grad = p.grad.clone()
        twin.step()
        direct.step()
    for p, c in zip(params, clones):
        assert torch.equal(p, c)


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.RMSprop, torch.optim.Adagrad])
def test_paged_is_refused_where_bitsandbytes_has_no_paged_twin(cls):
    optimizer = cls(_params(), lr=0.01, **({"momentum": 0.9} if cls is torch.optim.SGD else {}))
    with pytest.raises(ValueError, match=rf"paged=True is not allowed: .*{cls.__name__}'s 8-bit twin {cls.__name__}8bit has no paged"):
        build_twin(optimizer, min_8bit_size=4096, paged=True)


@pytest.mark.parametrize(("cls", "paged_cls"), [(torch.optim.AdamW, bnb.optim.PagedAdamW8bit), (bnb.optim.Lion, bnb.optim.PagedLion8bit)])
def test_paged_twins_where_bitsandbytes_has_them(cls, paged_cls):
    assert type(build_twin(cls(_params(), lr=1e-3), min_8bit_size=4096, paged=True)) is paged_cls
