import json
import logging

import pytest
import torch
from deepspeed.pipe import LayerSpec
from torch import nn

from ds_pipe_ext.costs import profiler
from ds_pipe_ext.costs.profiler import ProfileSettings, profile_layers
from ds_pipe_ext.models.gpt_config import load_model_config
from ds_pipe_ext.costs.layers import layer_names
from ds_pipe_ext.models.gpt import gpt_layer_specs, lm_loss

FAST = dict(warmup=0, repeats=1, progress=False)


def test_linear_layer_bytes_are_exact():
    specs = [LayerSpec(nn.Linear, 8, 16)]
    x = torch.randn(4, 8)
    (c,) = profile_layers(specs, x, settings=ProfileSettings(cache_dir=None, **FAST))
    assert c.activation_bytes == 4 * 8 * 4  # linear saves its input; the weight is a parameter, not counted
    assert c.output_bytes == 4 * 16 * 4
    assert c.param_bytes == c.grad_bytes == (8 * 16 + 16) * 4
    assert c.optimizer_bytes == (8 * 16 + 16) * 8  # Adam: two fp32 states
    assert c.forward_s > 0 and c.backward_s > 0 and c.recompute_s >= 0  # measured under the checkpoint


def tiny_inputs(cfg, b=2):
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def test_gpt_profile_shapes_and_loss_on_last_layer():
    cfg = load_model_config("tiny")
    specs = gpt_layer_specs(cfg)
    x, y = tiny_inputs(cfg)
    costs = profile_layers(specs, x, labels=y, loss_fn=lm_loss, names=layer_names(specs),
                           settings=ProfileSettings(cache_dir=None, **FAST))
    assert [c.name for c in costs] == ["EmbeddingPipe"] + ["Block"] * cfg.layers + ["HeadPipe"]
    h_bytes = 2 * cfg.seq_len * cfg.hidden * 4
    assert all(c.output_bytes == h_bytes for c in costs[:-1])
    assert costs[-1].output_bytes == 0  # the loss never crosses a boundary
    # identical blocks are measured once and share the numbers
    assert len({(c.forward_s, c.backward_s, c.activation_bytes) for c in costs[1:-1]}) == 1
    # the head keeps the logits' softmax for the loss: at least b*s*V fp32
    assert costs[-1].activation_bytes >= 2 * cfg.seq_len * cfg.vocab_size * 4
    emb_params = (cfg.vocab_size + cfg.seq_len) * cfg.hidden
    assert costs[0].param_bytes == emb_params * 4


def test_profiling_leaves_no_trace_on_rng():
    cfg = load_model_config("tiny")
    specs = gpt_layer_specs(cfg)
    x, y = tiny_inputs(cfg)
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    profile_layers(specs, x, labels=y, loss_fn=lm_loss, settings=ProfileSettings(cache_dir=None, **FAST))
    assert torch.equal(torch.rand(3), expected)


def test_cache_hit_and_corrupt_cache(tmp_path, monkeypatch, caplog):
    cfg = load_model_config("tiny")
    specs = gpt_layer_specs(cfg)
    x, y = tiny_inputs(cfg)
    settings = ProfileSettings(cache_dir=str(tmp_path), **FAST)
    first = profile_layers(specs, x, labels=y, loss_fn=lm_loss, settings=settings, key_fields={"model": "tiny"})
    (path,) = tmp_path.glob("profile-*.json")

    calls = []
    real = profiler.measure_layer
    monkeypatch.setattr(profiler, "measure_layer", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = profile_layers(specs, x, labels=y, loss_fn=lm_loss, settings=settings, key_fields={"model": "tiny"})
    assert again == first and calls == []  # served from the cache

    # anything in the key changes the file: a different micro-batch is profiled anew
    profile_layers(specs, x[:1], labels=y[:1], loss_fn=lm_loss, settings=settings, key_fields={"model": "tiny"})
    assert calls and len(list(tmp_path.glob("profile-*.json"))) == 2

    for garbage in ["{not json", json.dumps({"format": "other"}), json.dumps({"format": "ds_pipe_ext.profile/1", "layers": [{"name": 1}]})]:
        calls.clear()
        path.write_text(garbage)
        with caplog.at_level(logging.WARNING):
            redo = profile_layers(specs, x, labels=y, loss_fn=lm_loss, settings=settings, key_fields={"model": "tiny"})
        assert calls, "a corrupt cache must be re-profiled"
        assert "corrupt" in caplog.text and str(path) in caplog.text
        assert len(redo) == len(specs)
        assert json.loads(path.read_text())["format"] == "ds_pipe_ext.profile/1"  # rewritten


def test_bad_profile_settings():
    with pytest.raises(ValueError, match="repeats"):
        ProfileSettings(repeats=0)


def test_profiling_frees_the_layers_it_built():
    """The activation-counting forward must not leave a graph that holds its own outputs (a cycle
    through C++ the garbage collector cannot free): after profiling, no layer it built is alive."""
    import gc

    class Saves(nn.Module):  # tanh and softmax save their outputs
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(37, 37)

        def forward(self, x):
            return torch.softmax(torch.tanh(self.proj(x)), dim=-1)

    def live():
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, nn.Parameter) and tuple(o.shape) == (37, 37))

    before = live()
    profile_layers([LayerSpec(Saves)] * 3, torch.randn(8, 37), settings=ProfileSettings(cache_dir=None, **FAST))
    assert live() == before


MEASURE_ONCE = """
import sys, time
from pathlib import Path
from ds_pipe_ext.costs.cache import measured_once
path, log = Path(sys.argv[1]), Path(sys.argv[2])

def measure():
    with log.open("a") as f:
        f.write("measured\\n")
    time.sleep(0.5)  # a measurement others would run beside, without the lock
    return 42

print(measured_once(path, measure, parse=int, dump=int))
"""


def test_a_cached_measurement_asked_for_at_once_is_made_once(tmp_path):
    """Three processes ask for the same cached measurement together: one makes it, the others read it."""
    import subprocess
    import sys

    path, log = tmp_path / "cache" / "spec.json", tmp_path / "log"
    procs = [subprocess.Popen([sys.executable, "-c", MEASURE_ONCE, str(path), str(log)], stdout=subprocess.PIPE,
                              text=True) for _ in range(3)]
    assert [p.communicate(timeout=120)[0].strip() for p in procs] == ["42"] * 3
    assert log.read_text() == "measured\n"
