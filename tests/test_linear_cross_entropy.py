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


def test_the_fused_loss_gets_every_row_with_the_padded_columns_masked(monkeypatch):
    """On CUDA the chunked head's loss is liger-kernel's (``ChunkedLinearLoss``): it is handed the padded weight, so
    that its GEMMs stay aligned, and a bias of -inf on the padded columns.  Run here with a stand-in of liger's loss
    (the mean cross-entropy of hidden x weight^T + bias) and hidden states that say they are on CUDA: the loss and
    both gradients are the real rows' plain loss's, the padded rows get none."""
    import ds_pipe_ext.models.linear_cross_entropy as lce
    from ds_pipe_ext.models.layers import ChunkedLinearLoss

    handed = {}

    def fused(weight, hidden, labels, bias=None):
        handed.update(rows=weight.shape[0], bias=bias)
        logits = hidden @ weight.t() + (bias if bias is not None else 0)
        return F.cross_entropy(logits.float(), labels, ignore_index=-100)

    class OnCuda(torch.Tensor):  # only ChunkedLinearLoss's device test sees it
        @property
        def is_cuda(self):
            return True

    monkeypatch.setattr(lce, "liger_loss", lambda: fused)
    hidden, weight, labels, vocab = _case()
    ref = _plain(hidden, weight, labels, vocab)
    ref_h, ref_w = torch.autograd.grad(ref, (hidden, weight))
    got = ChunkedLinearLoss(vocab, 16)((hidden.as_subclass(OnCuda), weight), labels)
    got_h, got_w = torch.autograd.grad(got, (hidden, weight))
    assert handed["rows"] == 320 and handed["bias"][:vocab].eq(0).all() and handed["bias"][vocab:].eq(-torch.inf).all()
    assert got.item() == pytest.approx(ref.item(), abs=1e-6)
    assert torch.allclose(got_h, ref_h, atol=1e-6) and torch.allclose(got_w, ref_w, atol=1e-6)
    assert not got_w[vocab:].any()
    # an unpadded head is handed as it is, without a bias
    real = weight[:vocab]
    assert lce.padded_head_operands(real, vocab)[0] is real and lce.padded_head_operands(real, vocab)[1] is None
    with pytest.raises(ValueError, match="vocab_size 400 exceeds the head's 320 rows"):
        lce.padded_head_operands(weight, 400)


def _trained(name: str, chunk: int, *, recompute: bool = False, **overrides):
    from ds_pipe_ext.models import family_of, load_model

    cfg = load_model(name, vocab_size=500, vocab_pad_to=64, loss_chunk_tokens=chunk, **overrides)
    family = family_of(cfg)
    model = family.sequential(family.layer_specs(cfg), family.loss_fn(cfg), base_seed=3, recompute=recompute)
    x = torch.randint(0, 500, (2, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 500, (2, cfg.seq_len), generator=torch.Generator().manual_seed(2))
    loss = model(x, y)
    loss.backward()
    return loss.item(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("name, overrides, recompute", [
    ("tiny", {}, False), ("tiny", {"tie_embeddings": True}, False), ("tiny", {"tie_embeddings": True}, True),
    ("llama-tiny", {}, False), ("llama-tiny", {"tie_embeddings": True}, True)],
    ids=["gpt", "gpt-tied", "gpt-tied-recompute", "llama", "llama-tied-recompute"])
def test_a_model_with_the_chunked_loss_trains_as_with_the_plain_one(name, overrides, recompute):
    """The head hands the loss its hidden states and an alias of its weight (the embedding's, tied): the same
    loss and every gradient, the tied matrix's from both its uses, under layer recompute too."""
    plain_loss, plain_grads = _trained(name, 0, recompute=recompute, **overrides)
    loss, grads = _trained(name, 16, recompute=recompute, **overrides)
    assert loss == pytest.approx(plain_loss, abs=1e-5)
    assert len(grads) == len(plain_grads)
    for a, b in zip(grads, plain_grads):
        assert torch.allclose(a, b, atol=1e-5)


def test_the_profiled_and_the_analytic_chunked_head_hand_the_loss_hidden_states_not_logits():
    from ds_pipe_ext.costs.estimate import EstimateRequest, analytic_layer_costs
    from ds_pipe_ext.costs.hardware import get_device
    from ds_pipe_ext.costs.layers import layer_names
    from ds_pipe_ext.costs.profiler import ProfileSettings, profile_layers
    from ds_pipe_ext.models import family_of, load_model

    costs = {}
    for chunk in (0, 64):
        cfg = load_model("tiny", loss_chunk_tokens=chunk, tie_embeddings=True)
        family = family_of(cfg)
        specs = family.layer_specs(cfg)
        x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
        profiled = profile_layers(specs, x, labels=x, loss_fn=family.loss_fn(cfg), names=layer_names(specs),
                                  settings=ProfileSettings(cache_dir=None, warmup=0, repeats=1, progress=False))
        analytic = analytic_layer_costs(cfg, EstimateRequest(micro_batch=2, seq=cfg.seq_len, dtype="fp32"),
                                        get_device("h200"), runs_on="cuda")
        costs[chunk] = profiled[-1], analytic[-1]
    tokens, h, v = 2 * cfg.seq_len, cfg.hidden, cfg.vocab_size
    assert costs[0][0].loss_input_bytes == costs[0][1].loss_input_bytes == tokens * v * 4  # the logits
    assert costs[64][0].loss_input_bytes == costs[64][1].loss_input_bytes == tokens * h * 4  # hidden states only
    # analytic, at the sizes of a GPT head: the chunked head's peak at least 3x lower (gpt2-small, 8 x 1,024)
    req = EstimateRequest(micro_batch=8, seq=1024, dtype="bf16")
    peaks = [analytic_layer_costs(load_model("gpt2-small", loss_chunk_tokens=c), req, get_device("h200"),
                                  runs_on="cuda")[-1].peak_bytes for c in (0, 2048)]
    assert peaks[0] > 3 * peaks[1]


def test_the_chunked_loss_setting_is_checked():
    from ds_pipe_ext.models import load_model
    from ds_pipe_ext.models.config import ModelConfigError

    with pytest.raises(ModelConfigError, match="loss_chunk_tokens = -1"):
        load_model("tiny", loss_chunk_tokens=-1)
    with pytest.raises(ModelConfigError, match="not built for Mixture-of-Experts"):
        load_model("moe-tiny", loss_chunk_tokens=1024)
