import pytest
import torch

from ds_pipe_ext.models.config import GPTConfig, load_model_config
from ds_pipe_ext.parallel import cpu_compat
from ds_pipe_ext.parallel.topology import ParallelDims, TopologyError, check_agreement, deepspeed_groups


@pytest.mark.parametrize("pp, tp, dp", [(1, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2), (4, 2, 1), (3, 2, 2)])
def test_deepspeed_and_megatron_agree_on_every_group(pp, tp, dp):
    dims = ParallelDims(pp=pp, tp=tp, dp=dp)
    check_agreement(dims)
    groups = deepspeed_groups(dims)
    assert sorted(r for g in groups["tp"] for r in g) == list(range(dims.world_size))
    if tp > 1:
        assert groups["tp"][0] == list(range(tp))  # TP ranks are neighbours (one node, fastest links)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: ParallelDims.from_world(6, pp=4, tp=1), "not pipeline"),
        (lambda: ParallelDims.from_world(4, pp=2, tp=3), "not pipeline"),
        (lambda: ParallelDims(pp=2, tp=1, sp=True), "sequence parallelism needs tensor parallelism"),
        (lambda: ParallelDims(pp=0), "positive integers"),
        (lambda: ParallelDims(tp=3).check_model(load_model_config("tiny")), "does not divide the attention heads"),
        (lambda: ParallelDims(tp=2, sp=True).check_model(
            GPTConfig.from_dict({**load_model_config("tiny").to_dict(), "seq_len": 33}, name="odd")),
         "splits the sequence"),
    ],
)
def test_bad_topology_is_a_clear_error_before_any_process_group(make, match):
    import torch.distributed as dist

    with pytest.raises(TopologyError, match=match):
        make()
    assert not dist.is_initialized()


def test_cpu_shim_patches_only_megatron_and_only_without_cuda(monkeypatch):
    from megatron.core import utils

    assert cpu_compat.install() is True and cpu_compat.installed()
    buf = utils.GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "probe")  # needs the shim on CPU
    assert buf.device.type == "cpu" and buf.shape == (2, 3)
    assert torch.cuda.current_device is not cpu_compat._CpuTorch.cuda.current_device  # torch itself untouched
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_compat.install() is False


def test_vocabulary_padding_makes_tp_possible():
    cfg = load_model_config("bench-cpu")
    with pytest.raises(TopologyError, match="vocab_pad_to = 256"):
        ParallelDims(tp=2).check_model(cfg)
    padded = GPTConfig.from_dict({**cfg.to_dict(), "vocab_pad_to": 128}, name="padded")
    assert padded.padded_vocab == 50304
    ParallelDims(tp=2).check_model(padded)
