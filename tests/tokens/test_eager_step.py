"""The eager chunk step's work: no fresh ``[rows, vocab]`` tensor per chunk (on CPU, where torch has no
caching allocator, each one is mapped and page-faulted in again), the chunk size picked for a small
head, and the streaming path's losses and entropies bit for bit those of ``linear_cross_entropy``."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_efficient.tokens.linear_ce import auto_chunk_size, linear_cross_entropy
from lightning_efficient.tokens.streaming import streaming_cross_entropy

N, D, V = 96, 8, 67


class _FreshVocabRows(TorchDispatchMode):
    """Counts the tensors with vocabulary-wide rows (``[rows > 1, vocab]``) that ops return in new
    storage (not written into one of their inputs: an ``out=`` buffer or an in-place update)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.count = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[1] == self.vocab and t.shape[0] > 1
                    and t.untyped_storage().data_ptr() not in inputs):
                self.count += 1
        return out


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g).requires_grad_()
    weight = torch.randn(V, D, generator=g).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::7] = -100
    return hidden, weight, labels


def _fresh(run, chunk_size) -> int:
    hidden, weight, labels = _inputs()
    with _FreshVocabRows(V) as mode:
        run(hidden, weight, labels, chunk_size)
    return mode.count


def _mean(hidden, weight, labels, chunk_size):
    linear_cross_entropy(hidden, weight, labels, chunk_size=chunk_size, reduction="mean", compile=False).backward()


def _per_token_backward(hidden, weight, labels, chunk_size):
    losses, _ = linear_cross_entropy(hidden, weight, labels, chunk_size=chunk_size, return_entropy=True, compile=False)
    (losses * (torch.arange(N) % 3 != 0)).sum().backward()


def _streamed(score):
    def run(hidden, weight, labels, chunk_size):
        keep = torch.arange(N) % 3 != 0  # some rows of every chunk
        out = streaming_cross_entropy(hidden, weight, labels, chunk_size=chunk_size, keep=keep, score=score,
                                      return_scores=True, compile=False)
        out.kept_sum.backward()
    return run


@pytest.mark.parametrize("run", [_mean, _per_token_backward, _streamed("loss"), _streamed("entropy")],
                         ids=["mean", "per-token backward", "streamed loss", "streamed entropy"])
def test_the_eager_step_allocates_no_vocabulary_rows_per_chunk(run):
    """Twelve chunks allocate what two do: the step's [rows, vocab] buffers once per pass."""
    assert _fresh(run, 8) == _fresh(run, 48) <= 4


def test_a_small_head_gets_cache_sized_chunks():
    # the demo's head (vocabulary 8k, hidden 128): 8 MiB of float32 logits, not 32 MiB
    assert auto_chunk_size(8192, hidden_size=128) == 256
    # a wide hidden size keeps at least 2 x hidden rows, up to 32 MiB of logits
    assert auto_chunk_size(32768, hidden_size=512) == 256
    assert auto_chunk_size(8192, hidden_size=256) == 512
    assert auto_chunk_size(32768, fused=True, hidden_size=512) == 512  # the compiled step's 64 MiB
    assert auto_chunk_size(8192, hidden_size=128, device=torch.device("cuda")) == 1024  # CUDA: fewer launches


@pytest.mark.parametrize("chunk_size", [8, 40, None])
def test_streamed_losses_and_entropies_are_linear_cross_entropys_bit_for_bit(chunk_size):
    """float32: a threshold read off the per-token path's scores keeps exactly its tokens."""
    hidden, weight, labels = _inputs(seed=1)
    losses, entropy = linear_cross_entropy(hidden, weight, labels, chunk_size=chunk_size, return_entropy=True,
                                           compile=False)
    losses, entropy = losses.detach(), entropy.detach()
    for score, want in (("loss", losses), ("entropy", entropy)):
        out = streaming_cross_entropy(hidden, weight, labels, chunk_size=chunk_size, threshold=float(want.median()),
                                      score=score, compile=False)
        assert torch.equal(out.losses, losses)
        assert torch.equal(out.scores, want)
        assert torch.equal(out.keep, (labels != -100) & (want >= want.median()))
