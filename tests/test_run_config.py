"""The run config: typed, validated before any process group, the CLI through the same checks."""

import json

import numpy as np
import pytest
import torch

from ds_pipe_ext.cli import main as cli
from ds_pipe_ext.config_model import ConfigError
from ds_pipe_ext.models.gpt_config import load_model_config
from ds_pipe_ext.pipe.config import PipelineSettings
from ds_pipe_ext.train import checkpoint
from ds_pipe_ext.train.config import build_run_config
from ds_pipe_ext.train.data import IndexedTokens, SyntheticTokens

BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "pipeline": {"stages": 2, "partition_method": "profiled"}}


@pytest.mark.parametrize("section, match", [
    ({"tensor_parallel": {"size": 2, "sequence_parallel": "false"}},
     r"tensor_parallel.sequence_parallel = 'false': Input should be a valid boolean"),
    ({"train": {"model": "tiny", "stepz": 3}}, r"unknown key 'train.stepz'; valid keys here are \[.*'steps'"),
    ({"train": {"save_interval": -1}}, r"train.save_interval = -1: Input should be greater than or equal to 0"),
    ({"pipeline": {"stages": 2, "instrument": {"every": -2}}}, r"pipeline.instrument.every = -2"),
    ({"pipeline": {"stages": 2, "analytic": {"device": "a100", "dtype": "fp8"}}}, r"pipeline.analytic.dtype = 'fp8'"),
    ({"pipeline": {"stages": 2, "analytic": {"calibrat": True}}}, r"unknown key 'pipeline.analytic.calibrat'"),
    ({"pipeline": {"stages": 0}}, r"stages = 0"),
    ({"tensor_parallel": {"size": 1, "sequence_parallel": True}}, "needs tensor_parallel.size > 1"),
    ({"train": "tiny"}, r'"train" must be an object'),
    ({"train": {"recompute": "full"}, "pipeline": {"stages": 2, "instrument": {"per_layer": True}}},
     r"per_layer times each layer by module hooks, and a recomputed layer"),
    ({"pipeline": {"stages": 2, "activation_checkpoint_interval": 2, "instrument": {"per_layer": True}}},
     r"turn per_layer off, or train without recompute"),
])
def test_a_bad_key_is_an_error_that_names_it(section, match):
    with pytest.raises(ConfigError, match=match):
        build_run_config({**BASE, **section})


def test_deepspeed_keys_in_the_pipeline_section_stay_accepted_and_nothing_is_mutated():
    ds = {**BASE, "pipeline": {"stages": "auto", "partition": "best", "seed_layers": True, "pipe_partitioned": True,
                               "grad_partitioned": False, "use_reentrant": False, "activation_checkpoint_interval": 0,
                               "partition_method": "uniform"},
          "tensor_parallel": {"size": 2, "sequence_parallel": True}}
    before = json.dumps(ds, sort_keys=True)
    cfg = build_run_config(ds, train={"steps": 3}, pipeline={"partition_method": "profiled"})
    assert json.dumps(ds, sort_keys=True) == before  # the caller's dict is untouched
    assert cfg.pipeline.stages == "auto" and cfg.pipeline.partition_method == "profiled" and cfg.train.steps == 3
    derived = cfg.deepspeed_config()
    assert derived["pipeline"]["pipe_partitioned"] is False  # SP shards travel whole
    assert cfg.deepspeed_config() is not derived and "train" not in derived and "tensor_parallel" not in derived
    with pytest.raises(Exception):
        cfg.train.steps = 4  # frozen
    with pytest.warns(FutureWarning, match="link_bandwidth_gbs"):
        assert PipelineSettings.from_ds_config({"pipeline": {"link_bandwidth_gbps": 2}}).link_bandwidth == 2e9
    full = build_run_config({**BASE, "train": {"recompute": "full"}})
    assert full.pipeline.activation_checkpoint_interval == 1
    with pytest.raises(ConfigError, match="no \"pipeline\" section"):
        build_run_config({"train_micro_batch_size_per_gpu": 1}, pipeline={"partition_method": "profiled"})


def test_cli_arguments_go_through_the_same_checks(tmp_path, capsys):
    args = ["partition", "--model", "tiny", "--stages", "2", "--warmup", "0", "--repeats", "1",
            "--cache-dir", str(tmp_path)]
    assert cli([*args, "--micro-batch", "0"]) == 2
    assert "micro_batch = 0: Input should be greater than or equal to 1" in capsys.readouterr().err
    assert cli([*args, "--memory-cap-gib", "-1"]) == 2
    assert "memory_cap_gib = -1.0: Input should be greater than 0" in capsys.readouterr().err


def test_hugging_face_gpt2_config_json(tmp_path, capsys):
    hf = {"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 96, "n_positions": 16,
          "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.0, "model_type": "gpt2"}
    path = tmp_path / "gpt2-mini" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(hf))
    cfg = load_model_config(path)
    assert (cfg.name, cfg.hidden, cfg.layers, cfg.heads, cfg.vocab_size, cfg.seq_len, cfg.tie_embeddings) == \
        ("gpt2-mini", 32, 2, 4, 96, 16, True)
    assert cli(["partition", "--model", str(path), "--stages", "2", "--warmup", "0", "--repeats", "1",
                "--cache-dir", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parts"][-1] == 2 + 3  # embedding, 2 blocks, final norm, tied head


def build_indexed(prefix, docs):
    """A Megatron indexed dataset (PREFIX.bin, PREFIX.idx) written with megatron-core's own builder."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for doc in docs:
        builder.add_item(torch.tensor(doc, dtype=torch.int32))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


def test_indexed_tokens_cross_documents_stride_by_rank_and_resume(tmp_path):
    prefix = str(tmp_path / "toy")
    build_indexed(prefix, [list(range(0, 7)), list(range(7, 20)), list(range(20, 40))])
    stream = IndexedTokens(prefix, 2, 4, vocab=64, dp_rank=1, dp=2)  # windows of 5 tokens
    x, y = next(stream)
    # rank 1 of 2 reads windows 2 and 3 first: tokens 10..14 and 15..19 (window 1 spans two documents)
    assert x.tolist() == [[10, 11, 12, 13], [15, 16, 17, 18]] and y.tolist() == [[11, 12, 13, 14], [16, 17, 18, 19]]
    again = IndexedTokens(prefix, 2, 4, vocab=64, dp_rank=1, dp=2, position=1)
    assert torch.equal(next(again)[0], next(stream)[0])  # a resumed stream continues exactly
    assert [int(t) for t in IndexedTokens(prefix, 1, 4, vocab=64, dp_rank=0, dp=1)._window(1)] == [5, 6, 7, 8, 9]
    with pytest.raises(ConfigError, match="token id 39 >= the model's vocab_size 32"):
        IndexedTokens(prefix, 1, 4, vocab=32, dp_rank=0, dp=1)
    with pytest.raises(ConfigError, match="nope.bin is missing"):
        IndexedTokens(str(tmp_path / "nope"), 1, 4, vocab=64, dp_rank=0, dp=1)
    s1, s2 = SyntheticTokens(50, 2, 4, seed=3), SyntheticTokens(50, 2, 4, seed=3, position=2)
    next(s1), next(s1)
    assert torch.equal(next(s1)[0], next(s2)[0])
    # a step's samples are the same whatever dp x accumulation makes its global batch of 8: a resume on
    # half the ranks, accumulating twice as much, reads the samples the lost ranks would have
    def step_samples(dp: int, accum: int, step: int) -> set:
        streams = [SyntheticTokens(50, 2, 4, seed=3, dp_rank=r, dp=dp, position=step * accum) for r in range(dp)]
        return {tuple(row.tolist()) for s in streams for _ in range(accum) for row in next(s)[0]}

    assert step_samples(4, 1, 3) == step_samples(2, 2, 3) == step_samples(1, 4, 3)
    assert len(step_samples(4, 1, 3)) == 8 and step_samples(4, 1, 3) != step_samples(4, 1, 2)


def test_a_checkpoint_with_a_missing_or_truncated_file_is_refused(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="latest is missing"):
        checkpoint.verify(tmp_path)
    ckpt = tmp_path / "global_step2"
    ckpt.mkdir()
    (tmp_path / "latest").write_text("global_step2")
    with pytest.raises(checkpoint.CheckpointError, match="manifest.json is missing: the checkpoint .* is incomplete"):
        checkpoint.verify(tmp_path)
    (ckpt / "a.pt").write_bytes(b"x" * 10)
    (ckpt / "b.pt").write_bytes(b"y" * 10)
    (ckpt / "manifest.json").write_text(json.dumps({"step": 2, "tag": "global_step2", "layout": {},
                                                     "files": {"a.pt": 10, "b.pt": 10}}))
    assert checkpoint.verify(tmp_path)["step"] == 2
    (ckpt / "b.pt").write_bytes(b"y" * 4)
    with pytest.raises(checkpoint.CheckpointError, match=r"b.pt is truncated \(4 of 10 bytes\)"):
        checkpoint.verify(tmp_path)
    (ckpt / "a.pt").unlink()
    with pytest.raises(checkpoint.CheckpointError, match="a.pt is missing"):
        checkpoint.verify(tmp_path)


def test_full_and_selective_recompute_keep_the_math(tmp_path):
    """Recomputation changes what is kept for backward, never the loss or the gradients."""
    from ds_pipe_ext.models.gpt import lm_loss

    cfg = load_model_config("tiny")
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    grads = {}
    for name, kwargs, recompute in [("none", {}, False), ("selective", {"selective_recompute": True}, False),
                                    ("full", {}, True)]:
        from ds_pipe_ext.models.gpt import SequentialGPT, gpt_layer_specs

        model = SequentialGPT(gpt_layer_specs(cfg, **kwargs), lm_loss, base_seed=5, recompute=recompute)
        loss = model(x, x)
        loss.backward()
        grads[name] = (float(loss.detach()), [p.grad.clone() for p in model.parameters()])
    for name in ("selective", "full"):
        assert grads[name][0] == grads["none"][0]
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads[name][1], grads["none"][1]))


def test_only_the_newest_complete_checkpoints_are_kept(tmp_path):
    for step in (2, 3, 4, 6):
        d = tmp_path / checkpoint.tag_for(step)
        d.mkdir()
        if step != 3:  # step 3 was interrupted: no manifest
            (d / checkpoint.MANIFEST).write_text("{}")
    checkpoint._prune(tmp_path, keep_last=2, newest=6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step4", "global_step6"]


@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 4097, 300_001])
def test_squared_l2_matches_float64(n):
    from ds_pipe_ext.train.grad_norm import squared_l2

    g = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3.0
    want = float(g.double().pow(2).sum())
    assert float(squared_l2(g)) == pytest.approx(want, rel=1e-5, abs=1e-12)
    assert float(squared_l2(g.view(-1, 1) if n else g)) == pytest.approx(want, rel=1e-5, abs=1e-12)  # any shape
    b = g.bfloat16()
    assert float(squared_l2(b)) == pytest.approx(float(b.double().pow(2).sum()), rel=1e-5, abs=1e-12)


def test_zero_offload_trains_with_deepspeeds_cpu_adam(monkeypatch):
    """DeepSpeed refuses any client optimizer but its CPU Adam under ZeRO-Offload (a ds.json that
    offloads the optimizer once stopped train.py at initialize); without offload torch's AdamW stays."""
    import deepspeed.ops.adam as ds_adam

    from ds_pipe_ext.train.build import make_adamw

    made = []

    class RecordingCPUAdam:  # the real op compiles for about a minute on first use
        def __init__(self, params, *, lr, adamw_mode):
            made.append((len(list(params)), lr, adamw_mode))

    monkeypatch.setattr(ds_adam, "DeepSpeedCPUAdam", RecordingCPUAdam)
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    assert isinstance(make_adamw(params, lr=1e-3, offload=True), RecordingCPUAdam)
    assert made == [(2, 1e-3, True)]
    assert isinstance(make_adamw(params, lr=1e-3), torch.optim.AdamW)


def test_fp32_matmuls_on_cuda_use_tf32_unless_the_config_says_no(monkeypatch):
    """train.tf32 (default on) sets the flags MFU and the cuda spec read, before anything is built; a CPU run
    leaves them alone (build asks for CUDA first)."""
    from ds_pipe_ext.train import build as train_build

    assert build_run_config(BASE).train.tf32 is True
    assert build_run_config({**BASE, "train": {"tf32": False}}).train.tf32 is False
    with pytest.raises(ConfigError, match=r"train.tf32 = 'often'"):
        build_run_config({**BASE, "train": {"tf32": "often"}})
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        train_build.use_tf32(True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        train_build.use_tf32(False)
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        # on CUDA, build applies the setting before loading the model; on a CPU it does not touch the flags
        seen = []
        monkeypatch.setattr(train_build, "use_tf32", seen.append)
        monkeypatch.setattr(train_build, "load_model", lambda name: (_ for _ in ()).throw(RuntimeError("stop")))
        cfg = build_run_config({**BASE, "train": {"tf32": False}})
        for cuda, expected in ((False, []), (True, [False])):
            monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
            with pytest.raises(RuntimeError, match="stop"):
                train_build.build(cfg)
            assert seen == expected
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
