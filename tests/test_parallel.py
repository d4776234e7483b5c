import pytest
import torch

from ds_pipe_ext.models.gpt_config import GPTConfig, load_model_config
from ds_pipe_ext.compat import cpu_shims
from ds_pipe_ext.layout import Layout, LayoutError
from ds_pipe_ext.parallel.topology import check_agreement, deepspeed_groups


@pytest.mark.parametrize("pp, tp, dp", [(1, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2), (4, 2, 1), (3, 2, 2)])
def test_deepspeed_and_megatron_agree_on_every_group(pp, tp, dp):
    dims = Layout(pp=pp, tp=tp, dp=dp)
    check_agreement(dims)
    groups = deepspeed_groups(dims)
    assert sorted(r for g in groups["tp"] for r in g) == list(range(dims.world_size))
    if tp > 1:
        assert groups["tp"][0] == list(range(tp))  # TP ranks are neighbours (one node, fastest links)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Layout.from_world(6, pp=4, tp=1), "not pipeline"),
        (lambda: Layout.from_world(4, pp=2, tp=3), "not pipeline"),
        (lambda: Layout(pp=2, tp=1, sp=True), "sequence parallelism needs tensor parallelism"),
        (lambda: Layout(pp=0), "a positive integer"),
        (lambda: Layout(tp=3).check(load_model_config("tiny")), "does not divide the attention heads"),
        (lambda: Layout(tp=2, sp=True).check(
            GPTConfig.from_dict({**load_model_config("tiny").to_dict(), "seq_len": 33}, name="odd")),
         "splits the sequence"),
    ],
)
def test_bad_topology_is_a_clear_error_before_any_process_group(make, match):
    import torch.distributed as dist

    with pytest.raises(LayoutError, match=match):
        make()
    assert not dist.is_initialized()


@pytest.fixture
def shims_restored():
    """The shim patches module globals of megatron: give them back after the test."""
    import importlib

    before = {name: importlib.import_module(name).torch for name in cpu_shims.PATCHED_MODULES}
    yield
    cpu_shims.uninstall()
    for name, original in before.items():
        importlib.import_module(name).torch = original


def test_cpu_shim_patches_only_megatron_and_only_without_cuda(shims_restored, monkeypatch):
    import importlib

    from megatron.core import utils

    cpu_shims.uninstall()
    assert not cpu_shims.installed()
    with pytest.raises((AssertionError, RuntimeError)):  # megatron's buffer asks CUDA for a device
        utils.GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "probe-before")
    assert cpu_shims.install() is True and cpu_shims.installed()
    buf = utils.GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "probe")  # needs the shim on CPU
    assert buf.device.type == "cpu" and buf.shape == (2, 3)
    assert torch.cuda.current_device is not cpu_shims._CpuTorch.cuda.current_device  # torch itself untouched
    cpu_shims.uninstall()
    assert all(importlib.import_module(n).torch is torch for n in cpu_shims.PATCHED_MODULES)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_shims.install() is False and not cpu_shims.installed()


def test_vocabulary_padding_makes_tp_possible():
    cfg = load_model_config("bench-cpu")
    with pytest.raises(LayoutError, match="vocab_pad_to = 256"):
        Layout(tp=2).check(cfg)
    padded = GPTConfig.from_dict({**cfg.to_dict(), "vocab_pad_to": 128}, name="padded")
    assert padded.padded_vocab == 50304
    Layout(tp=2).check(padded)


MALLOC_PROBE = """
import ctypes, sys
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype, libc.malloc.restype, libc.malloc.argtypes = MallInfo2, ctypes.c_void_p, [ctypes.c_size_t]
if sys.argv[1] == "fixed":
    from ds_pipe_ext.compat.cpu_shims import steady_host_allocator
    print("fixed", steady_host_allocator())
if sys.argv[1] == "drop-in":  # a user's script: one rank that never profiles builds the module
    import os, deepspeed, torch
    from ds_pipe_ext import PipelineModule
    from ds_pipe_ext.compat.cpu_shims import skip_deepspeed_shm_op
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    skip_deepspeed_shm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    PipelineModule([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)], num_stages=1, partition_method="uniform")
before = libc.mallinfo2().hblks
block = libc.malloc(8 << 20)  # 8 MiB: above glibc's initial mmap threshold
print("mmapped", libc.mallinfo2().hblks - before)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the malloc shim is CPU-only")
def test_the_malloc_shim_serves_large_blocks_from_the_heap_and_can_be_declined():
    """Fresh processes: glibc mmaps an 8 MiB block; after steady_host_allocator() it comes from the heap.
    DS_PIPE_EXT_GLIBC_MALLOC=default leaves glibc as it is."""
    import ctypes
    import os
    import subprocess
    import sys

    try:
        ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        pytest.skip("not glibc >= 2.33")

    from ds_pipe_ext.runner import free_port

    def probe(mode, *args, **env):  # started at once, read below: each process spends seconds importing torch
        return subprocess.Popen([sys.executable, "-c", MALLOC_PROBE, mode, *args], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, **env})

    probes = [
        (probe("glibc"), ["mmapped", "1"]),
        (probe("fixed"), ["fixed", "True", "mmapped", "0"]),
        (probe("fixed", DS_PIPE_EXT_GLIBC_MALLOC="default"), ["fixed", "False", "mmapped", "1"]),
        # thresholds the environment fixed (compare --compact-malloc's 128 KiB) are kept, not overridden
        (probe("fixed", MALLOC_MMAP_THRESHOLD_="131072"), ["fixed", "False", "mmapped", "1"]),
        # the drop-in sets them on every rank, not only on the rank that profiles (issue 53)
        (probe("drop-in", str(free_port())), ["mmapped", "0"]),
        (probe("drop-in", str(free_port()), DS_PIPE_EXT_GLIBC_MALLOC="default"), ["mmapped", "1"]),
    ]
    for proc, expected in probes:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, (proc.args, expected)
        assert [word for word in out.split() if word in ("fixed", "mmapped", "True", "False", "0", "1")] == expected


def test_the_cpu_spec_charges_page_faults_above_the_threshold_training_runs_with(monkeypatch):
    """train.py fixes glibc's mmap threshold at 1 GiB; left to glibc it is at most 32 MiB, or what the
    environment set."""
    from ds_pipe_ext.compat.cpu_shims import training_mmap_threshold

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("DS_PIPE_EXT_GLIBC_MALLOC", raising=False)
    assert training_mmap_threshold() == 2.0**30
    monkeypatch.setenv("DS_PIPE_EXT_GLIBC_MALLOC", "default")
    assert training_mmap_threshold() == 32 * 2.0**20
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert training_mmap_threshold() == 131072.0
    monkeypatch.delenv("DS_PIPE_EXT_GLIBC_MALLOC")
    assert training_mmap_threshold() == 131072.0


def test_an_untested_deepspeed_warns_once_naming_it(monkeypatch):
    import importlib.metadata
    import warnings

    from ds_pipe_ext import compat

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.18.2" if name == "deepspeed" else real(name))
    with pytest.warns(UserWarning, match=r"tested with deepspeed >=0.19.0,<0.20, this is deepspeed 0.18.2"):
        compat._warn_untested_versions()
    monkeypatch.setattr(importlib.metadata, "version", real)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat._warn_untested_versions()  # the installed versions are the tested ones: silent
