"""The chunked head + cross-entropy (models.linear_cross_entropy) against the plain head and loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ds_pipe_ext.costs.probes import saved_activation_bytes
from ds_pipe_ext.models.layers import RealVocabLoss
from ds_pipe_ext.models.linear_cross_entropy import linear_cross_entropy


def _case(dtype=torch.float32, s=37, b=3, h=48, vocab=300, padded=320):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(s, b, h, generator=g).to(dtype).requires_grad_()
    weight = (0.2 * torch.randn(padded, h, generator=g)).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (b, s), generator=g)
    labels[0, :5] = -100  # ignored positions, as a causal-LM loss masks them
    return hidden, weight, labels, vocab


def _plain(hidden, weight, labels, vocab):
    return RealVocabLoss(vocab)(F.linear(hidden, weight), labels)


@pytest.mark.parametrize("chunk", [1, 16, 50, 4096])
def test_chunked_matches_the_plain_head_and_loss_in_fp32(chunk):
    hidden, weight, labels, vocab = _case()
    ref = _plain(hidden, weight, labels, vocab)
    ref_h, ref_w = torch.autograd.grad(ref, (hidden, weight))
    got = linear_cross_entropy(hidden, weight, labels, vocab_size=vocab, chunk_tokens=chunk)
    got_h, got_w = torch.autograd.grad(2.0 * got, (hidden, weight))  # a scaled upstream gradient too
    assert got.item() == pytest.approx(ref.item(), abs=1e-5)
    assert torch.allclose(got_h, 2.0 * ref_h, atol=1e-5) and torch.allclose(got_w, 2.0 * ref_w, atol=1e-5)
    assert not got_w[vocab:].any()  # the padded rows take no part


def test_chunked_in_bf16_within_a_percent_of_the_plain_loss():
    hidden, weight, labels, vocab = _case(torch.bfloat16)
    ref = _plain(hidden, weight, labels, vocab)
    got = linear_cross_entropy(hidden, weight, labels, vocab_size=vocab, chunk_tokens=16)
    assert got.dtype == torch.float32 and got.item() == pytest.approx(ref.item(), rel=1e-2)
    got.backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16


def test_chunked_keeps_no_logits_for_the_backward():
    """What autograd keeps from the forward: the plain loss its fp32 log-probabilities (tokens x V) beside
    the head's input; the chunked one the two gradients (tokens x h, V x h)."""
    hidden, weight, labels, vocab = _case(s=512, b=4, h=32, vocab=1000, padded=1024)
    plain, _ = saved_activation_bytes(lambda: _plain(hidden, weight, labels, vocab), [weight])
    chunked, _ = saved_activation_bytes(
        lambda: linear_cross_entropy(hidden, weight, labels, vocab_size=vocab, chunk_tokens=256), [weight])
    assert chunked == 2048 * 32 * 4 + 1024 * 32 * 4
    assert plain >= 2048 * 1000 * 4 and plain > 3 * chunked


def test_clear_errors():
    hidden, weight, labels, vocab = _case()
    with pytest.raises(ValueError, match="chunk_tokens = 0"):
        linear_cross_entropy(hidden, weight, labels, vocab_size=vocab, chunk_tokens=0)
    with pytest.raises(ValueError, match="vocab_size 400 exceeds the head's 320 rows"):
        linear_cross_entropy(hidden, weight, labels, vocab_size=400)
