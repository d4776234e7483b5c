"""Every tensor on the device of the tensors it meets, every collective on its group's device.

Gloo takes CPU tensors and forgives CUDA ones; NCCL takes CUDA tensors only, so a CPU test cannot
see this class of bug by running.  Two kinds of check instead:
* a lint over the package: torch's factory calls without ``device=`` and ``torch.load`` without
  ``map_location=`` must each be on a reviewed list of the ones meant for the CPU;
* the functions that issue collectives, run with parameters on the meta device (neither the CPU nor
  CUDA) and ``torch.distributed`` patched to assert the device of every tensor it is handed.
"""

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

PACKAGE = Path(__file__).resolve().parents[1] / "ds_pipe_ext"
META = torch.device("meta")
FACTORIES = {"zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "linspace", "eye", "rand", "randn",
             "randint", "randperm"}

# (module, enclosing function) -> why a factory call there is meant for the CPU
CPU_BY_DESIGN = {
    ("costs/cpu_comm.py", "_worker"): "measures gloo between CPU ranks",
    ("costs/cpu_spec.py", "_measure_cpu_now"): "measures the CPU spec",
    ("parallel/probe.py", "_worker"): "a CPU probe with its own gloo group",
    ("train/data.py", "_sample"): "token samples on the host (a CPU generator); the engine moves each batch to its device",
    ("models/costs.py", "_tokens"): "a profile batch on the host; the profiler moves it to its device",
    ("costs/profiler.py", "measure_layer"): "a seeded gradient drawn on the host, then moved to the device",
    ("models/layers.py", "__init__"): "a module's parameter at construction; the module is moved as a whole",
    ("models/llama.py", "__init__"): "a module's buffer at construction; the module is moved as a whole",
    ("models/gpt.py", "__init__"): "a module's buffer at construction; the module is moved as a whole",
    ("models/moe.py", "__init__"): "MoELoss's placeholders: a stage without the loss only reports their names",
    ("models/mamba2.py", "__init__"): "a module's parameters at construction; the module is moved as a whole",
    ("models/mtp.py", "__init__"): "MTPLoss's placeholders: a stage without the loss only reports their names",
    ("models/routers.py", "__init__"): "a gate's buffer at construction; the module is moved as a whole",
    ("models/sinks.py", "__init__"): "a module's parameter at construction; the module is moved as a whole",
}


def _calls(name_test, keyword: str):
    """(module, enclosing function, line) of each torch.<name> call without ``keyword=``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())

        def visit(node, where):
            for child in ast.iter_child_nodes(node):
                inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
                if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                        and isinstance(child.func.value, ast.Name) and child.func.value.id == "torch"
                        and name_test(child.func.attr) and keyword not in {k.arg for k in child.keywords}):
                    found.append((str(path.relative_to(PACKAGE)), where, child.lineno))
                visit(child, inner)

        visit(tree, "<module>")
    return found


def test_every_factory_call_names_its_device_or_is_reviewed_as_cpu():
    unreviewed = [c for c in _calls(FACTORIES.__contains__, "device") if c[:2] not in CPU_BY_DESIGN]
    assert not unreviewed, (f"torch factory calls without device= (a CPU tensor that meets CUDA ones): {unreviewed}; "
                            f"pass the device of the tensors it meets, or add it to CPU_BY_DESIGN with the reason")
    used = {c[:2] for c in _calls(FACTORIES.__contains__, "device")}
    assert set(CPU_BY_DESIGN) <= used, f"stale entries: {set(CPU_BY_DESIGN) - used}"


def test_every_script_that_starts_deepspeeds_group_skips_its_cpu_shm_build():
    """On a CPU, DeepSpeed's ``init_distributed`` JIT-compiles its shared-memory op (C++, ~26 s of both cores here),
    which only CPU inference's all-reduce uses, and compiles it again whenever another checkout's build flags are in
    ~/.cache/torch_extensions: each file that starts DeepSpeed's group calls ``skip_deepspeed_shm_op`` first (a
    bench that did not took 28-32 s where it takes 5)."""
    root = PACKAGE.parent
    starts = [f for d in ("ds_pipe_ext", "bench", "examples", "tests") for f in sorted((root / d).rglob("*.py"))
              if "deepspeed.init_distributed(" in f.read_text() and f.name != "test_devices.py"]
    assert len(starts) >= 6, starts
    missing = [str(f.relative_to(root)) for f in starts if "skip_deepspeed_shm_op()" not in f.read_text()]
    assert not missing, f"call compat.cpu_shims.skip_deepspeed_shm_op() before deepspeed.init_distributed in {missing}"


def test_every_torch_load_names_where_its_tensors_go():
    assert _calls("load".__eq__, "map_location") == []


class CollectiveReached(Exception):
    """The collective was called with the right device (the test stops there: meta holds no values)."""


@pytest.fixture
def collectives_on(monkeypatch):
    """Patch torch.distributed's collectives to assert every tensor is on ``want[0]``, then stop."""
    want = [META]

    def check(*args, **kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        assert tensors and all(t.device == want[0] for t in tensors), \
            f"collective on {[t.device for t in tensors]}, the group's device is {want[0]}"
        raise CollectiveReached

    for name in ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor"):
        monkeypatch.setattr(dist, name, check)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    return want


def test_the_grad_norm_reduces_on_the_gradients_device(collectives_on):
    from ds_pipe_ext.layout import Layout
    from ds_pipe_ext.train.grad_norm import global_grad_norm

    model = torch.nn.Linear(8, 8, device=META)
    for p in model.parameters():
        p.grad = torch.empty_like(p)
    with pytest.raises(CollectiveReached):
        global_grad_norm(model, Layout(dp=4))


def test_the_memory_cap_exchange_runs_on_the_groups_device(collectives_on):
    from ds_pipe_ext.train.trainer import over_memory_cap

    with pytest.raises(CollectiveReached):
        over_memory_cap(1.0, 2**31, META)


def test_decisions_are_broadcast_on_the_groups_device(monkeypatch):
    """Under NCCL the broadcast of rank 0's decision runs on this rank's GPU, cuda:LOCAL_RANK."""
    from ds_pipe_ext.pipe.decide import decide_and_broadcast

    seen = {}
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "broadcast_object_list", lambda objs, src, group=None, device=None:
                        seen.update(device=device))
    assert decide_and_broadcast(lambda: 1, what="x", rank=0) == 1
    assert seen["device"] == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    decide_and_broadcast(lambda: 1, what="x", rank=0)
    assert seen["device"] == torch.device("cpu")


def test_each_rank_selects_its_gpu_before_the_process_group_starts(monkeypatch):
    import deepspeed

    from ds_pipe_ext.train import build

    calls = []
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", torch.device(d))))
    monkeypatch.setattr(deepspeed, "init_distributed", lambda *a, **k: calls.append(("init_distributed",)))
    build.init_process_group()
    assert calls == [("set_device", torch.device("cuda", 2)), ("init_distributed",)]


def test_the_drop_in_module_selects_its_gpu_before_it_partitions(monkeypatch):
    """A user's script may build the PipelineModule without selecting a GPU: profiling and the partition's
    broadcast come before DeepSpeed moves the stage to cuda:LOCAL_RANK, so the module selects it first."""
    from ds_pipe_ext.pipe import module

    class Selected(Exception):
        pass

    monkeypatch.setattr(module, "select_rank_device", lambda: (_ for _ in ()).throw(Selected()))
    with pytest.raises(Selected):
        module.PipelineModule([torch.nn.Linear(2, 2)], num_stages=1, partition_method="uniform")


def test_a_checkpoint_keeps_this_ranks_cuda_generator(monkeypatch, tmp_path):
    """Dropout on a GPU draws from the CUDA generator: a resume restores it, or it is not bit-identical."""
    from ds_pipe_ext.train import checkpoint

    cuda_state = torch.arange(16, dtype=torch.uint8)
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": cuda_state.clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device="cuda": restored.append(s))
    checkpoint.write_rng(tmp_path / "rng.pt", checkpoint.rng_state())
    checkpoint.restore_rng(checkpoint.read_rng(tmp_path / "rng.pt"))
    assert len(restored) == 1 and torch.equal(restored[0], cuda_state) and restored[0].device.type == "cpu"


def test_without_cuda_the_rank_device_is_the_cpu_and_gloo_takes_cpu_tensors(monkeypatch):
    from ds_pipe_ext import device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert device.select_rank_device() == torch.device("cpu")
    assert device.collective_device() == torch.device("cpu")


@pytest.mark.parametrize("zero, dtype, on_gpu", [(0, "bf16", True), (1, "bf16", True), (1, "fp32", True),
                                                 (2, "fp32", True), (2, "bf16", False), (3, "fp32", False)])
def test_a_rank_builds_its_weights_on_its_gpu_unless_only_partitioned_states_fit(monkeypatch, zero, dtype, on_gpu):
    """ZeRO-0/1 (and fp32 ZeRO-2) hold at least the fp32 weights' bytes on the GPU while training: built there.
    ZeRO-3 and 16-bit ZeRO-2 hold less: built on the host, as DeepSpeed's engine takes them."""
    from ds_pipe_ext import device

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device.build_device(zero, dtype) == (torch.device("cuda", 1) if on_gpu else torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device.build_device(zero, dtype) == torch.device("cpu")


@pytest.mark.parametrize("zero, built_on", [(1, META), (3, torch.device("cpu"))])
def test_a_data_parallel_model_is_initialised_where_it_trains(monkeypatch, zero, built_on):
    from ds_pipe_ext import device
    from ds_pipe_ext.train import build
    from ds_pipe_ext.train.config import build_run_config

    monkeypatch.setattr(device, "rank_device", lambda: META)  # neither the host nor CUDA: where build_device points
    cfg = build_run_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": zero},
                            "bf16": {"enabled": True}, "train": {"model": "tiny"}})
    model_cfg = build.load_model(cfg.train.model)
    model = build.build_model(cfg, model_cfg, build.run_layout(cfg, model_cfg, 1))
    assert {p.device for p in model.parameters()} == {built_on}


def test_a_pipeline_stage_is_built_on_the_ranks_gpu(monkeypatch):
    """DeepSpeed builds a stage on the host and then moves it; the drop-in builds it where it moves it."""
    from ds_pipe_ext import device
    from ds_pipe_ext.pipe import module

    seen = []
    monkeypatch.setattr(device, "rank_device", lambda: META)
    monkeypatch.setattr(module._DeepSpeedPipelineModule, "_build", lambda self: seen.append(torch.empty(0).device))
    stage = module.PipelineModule.__new__(module.PipelineModule)
    object.__setattr__(stage, "_ext_zero_stage", 1)
    stage._build()
    assert seen == [META] and torch.empty(0).device == torch.device("cpu")


def test_the_profiler_builds_each_layer_on_the_device_it_measures_on():
    from deepspeed.pipe import LayerSpec

    from ds_pipe_ext.costs.layers import build_for_profiling

    module, _ = build_for_profiling(LayerSpec(torch.nn.Linear, 4, 4), META)
    assert {p.device for p in module.parameters()} == {META}
    module, _ = build_for_profiling(LayerSpec(torch.nn.Linear, 4, 4))
    assert {p.device for p in module.parameters()} == {torch.device("cpu")}


def test_rng_files_hold_tensors_and_numbers_and_load_without_unpickling(tmp_path):
    """A checkpoint's RNG file loads with weights_only=True (tensors only; the rest in its .json), and restores
    every generator: the next draws of torch, numpy and Python equal those after the save."""
    import random

    import numpy as np

    from ds_pipe_ext.train import checkpoint

    random.random(), np.random.rand(), torch.rand(1), random.gauss(0, 1), np.random.randn()  # mid-stream states
    checkpoint.write_rng(tmp_path / "rng.pt", checkpoint.rng_state())
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)), random.gauss(0, 1),
                float(np.random.randn()))
    assert set(torch.load(tmp_path / "rng.pt", weights_only=True)) >= {"torch", "numpy_keys", "python_internal"}
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    checkpoint.restore_rng(checkpoint.read_rng(tmp_path / "rng.pt"))
    assert (random.random(), float(np.random.rand()), float(torch.rand(1)), random.gauss(0, 1),
            float(np.random.randn())) == expected
    # an older checkpoint's pickled RNG file is refused by name, not unpickled
    (tmp_path / "rng.pt.json").unlink()
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"rng.pt.json is missing: .*older checkpoint \(a pickle, which is not loaded\)"):
        checkpoint.read_rng(tmp_path / "rng.pt")
