"""A padded vocabulary (``vocab_pad_to``) trains as the unpadded model: the loss runs over the real columns
(``models.layers.RealVocabLoss``), and a checkpoint refuses a resume across a change of its padding."""

from __future__ import annotations

import json

import pytest
import torch

from ds_pipe_ext.models import family_of, load_model
from ds_pipe_ext.train.checkpoint import CheckpointError, check_vocabulary, vocabulary_of


def _model(name: str, **overrides):
    cfg = load_model(name, **overrides)
    family = family_of(cfg)
    specs = family.layer_specs(cfg)
    return cfg, family.sequential(specs, family.loss_fn(cfg), base_seed=3, recompute=False)


@pytest.mark.parametrize("name, overrides", [("tiny", {}), ("tiny", {"tie_embeddings": True}), ("llama-tiny", {})],
                         ids=["gpt", "gpt-tied", "llama"])
def test_a_padded_vocabulary_gives_the_unpadded_loss_and_gradients(name, overrides):
    torch.manual_seed(0)
    cfg, plain = _model(name, vocab_size=500, **overrides)
    padded_cfg, padded = _model(name, vocab_size=500, vocab_pad_to=128, **overrides)
    assert (cfg.padded_vocab, padded_cfg.padded_vocab) == (500, 512)
    state = plain.state_dict()
    for key, value in padded.state_dict().items():  # the padded rows keep their own init; the real rows copied
        with torch.no_grad():
            value[: state[key].shape[0]].copy_(state[key])
    x = torch.randint(0, 500, (2, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 500, (2, cfg.seq_len), generator=torch.Generator().manual_seed(2))
    a, b = plain(x, y), padded(x, y)
    a.backward()
    b.backward()
    assert b.item() == pytest.approx(a.item(), abs=1e-5)
    for (key, p), q in zip(plain.named_parameters(), padded.parameters()):
        rows = p.shape[0]
        assert torch.allclose(q.grad[:rows], p.grad, atol=1e-5), key
        if q.shape != p.shape:  # the padded rows: no label reaches them, no softmax term holds them
            assert not q.grad[rows:].abs().any(), key


def test_padded_gpu_configs_are_multiples_of_128_and_cpu_bench_configs_unchanged():
    for name in ("gpt2-medium", "gpt3-small", "gpt3-1.3b"):
        assert load_model(name).padded_vocab == 50304
    for name in ("bench-cpu", "tiny", "gpt2-small"):
        cfg = load_model(name)
        assert cfg.padded_vocab == cfg.vocab_size


def test_a_checkpoint_refuses_a_resume_across_a_change_of_its_padding(tmp_path):
    saved = vocabulary_of(load_model("gpt2-medium", vocab_pad_to=1))
    manifest = json.loads(json.dumps({"vocabulary": saved}))
    check_vocabulary(manifest, saved, tmp_path)  # the same padding resumes
    check_vocabulary({}, vocabulary_of(load_model("gpt2-medium")), tmp_path)  # a manifest from before the record
    with pytest.raises(CheckpointError, match=r"padded_vocab = 50257 \(vocab_pad_to = 1\), this run has 50304 "
                                              r"\(vocab_pad_to = 128\).*resume with the model config's "
                                              r"vocab_pad_to = 1"):
        check_vocabulary(manifest, vocabulary_of(load_model("gpt2-medium")), tmp_path)
