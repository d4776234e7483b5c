import torch
from deepspeed.pipe import TiedLayerSpec

from ds_pipe_ext.costs.profiler import ProfileSettings, profile_layers
from ds_pipe_ext.models.gpt_config import GPTConfig, load_model_config
from ds_pipe_ext.costs.layers import layer_names
from ds_pipe_ext.models.gpt import SequentialGPT, gpt_layer_specs, lm_loss


def tokens(cfg, b=2):
    t = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    return t[:, :-1], t[:, 1:]


def test_untied_layout_and_loss():
    cfg = load_model_config("tiny")
    specs = gpt_layer_specs(cfg)
    assert layer_names(specs) == ["EmbeddingPipe"] + ["Block"] * cfg.layers + ["HeadPipe"]
    model = SequentialGPT(specs, base_seed=1)
    x, y = tokens(cfg)
    assert model(x).shape == (cfg.seq_len, 2, cfg.vocab_size)  # sequence-first, as Megatron
    loss = model(x, y)
    # fresh GPT-2 init predicts roughly uniformly: loss near log(V)
    assert abs(loss.item() - torch.log(torch.tensor(float(cfg.vocab_size))).item()) < 0.1


def test_tied_embedding_shares_one_matrix_and_profiles():
    cfg = GPTConfig.from_dict({**load_model_config("tiny").to_dict(), "tie_embeddings": True}, name="tiny-tied")
    specs = gpt_layer_specs(cfg)
    assert isinstance(specs[0], TiedLayerSpec) and isinstance(specs[-1], TiedLayerSpec)
    assert layer_names(specs)[-2:] == ["FinalNorm", "EmbeddingPipe.tied_lm_head"]
    model = SequentialGPT(specs, base_seed=1)
    untied = SequentialGPT(gpt_layer_specs(load_model_config("tiny")), base_seed=1)
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert n(untied) - n(model) == cfg.vocab_size * cfg.hidden  # the head reuses the embedding matrix
    x, y = tokens(cfg)
    model(x, y).backward()
    costs = profile_layers(specs, x, labels=y, loss_fn=lm_loss, names=layer_names(specs),
                           settings=ProfileSettings(cache_dir=None, warmup=0, repeats=1, progress=False))
    assert len(costs) == cfg.layers + 3 and costs[-1].output_bytes == 0


def test_seeded_layers_match_deepspeed_seed_layers():
    """Layer i starts from seed base + i, whatever else was built before it (DeepSpeed seed_layers)."""
    cfg = load_model_config("tiny")
    specs = gpt_layer_specs(cfg)
    model = SequentialGPT(specs, base_seed=100)
    torch.manual_seed(100 + 3)
    alone = specs[3].build()
    for a, b in zip(alone.parameters(), model.layers[3].parameters()):
        assert torch.equal(a, b)


def test_gpt_attention_picks_its_kernel_by_the_device_it_is_built_for(monkeypatch):
    """The GPT's "auto" attention: written out on a CPU, SDPA where CUDA is present (patched here), as the cost
    model's selector says for the same setting (arch.attention_backend)."""
    from ds_pipe_ext.arch import attention_backend
    from ds_pipe_ext.models.gpt import Block

    cfg = load_model_config("tiny")
    assert cfg.attention == "auto" and not Block(cfg).attn.sdpa
    assert attention_backend("auto", "cpu") == "eager"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert Block(cfg).attn.sdpa
    assert attention_backend("auto", "h200", dtype="bf16", head_dim=cfg.hidden // cfg.heads) == "cudnn"
