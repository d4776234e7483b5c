"""Costs and memory that hold on a GPU, checked where they can be without one: profiles in the run's precision
(and keyed by it), the timing protocol a GPU profile uses, the measured ``cuda`` spec's cache and refusal, one
dropout-mask rule, and a tied embedding/head counted once where one process holds both."""

import json
from dataclasses import replace

import pytest
import torch
from torch import nn

from ds_pipe_ext.compare.predict import model_shape
from ds_pipe_ext.costs import cuda_spec
from ds_pipe_ext.costs.op_cost import AnalyticError
from ds_pipe_ext.costs.estimate import EstimateRequest, analytic_layer_costs, dropout_mask_bytes
from ds_pipe_ext.costs.gpu_timing import forward_backward_s
from ds_pipe_ext.costs.hardware import DEVICES, get_device
from ds_pipe_ext.costs.probes import saved_activation_bytes
from ds_pipe_ext.costs.profiler import profile_layers
from ds_pipe_ext.costs.types import ProfileSettings
from ds_pipe_ext.models.gpt_config import load_model_config
from ds_pipe_ext.pipe.config import engine_dtype

QUICK = ProfileSettings(warmup=0, repeats=1, cache_dir=None, progress=False)


def test_the_engines_precision_is_read_from_ds_json():
    assert engine_dtype({"bf16": {"enabled": True}}) == "bf16"
    assert engine_dtype({"fp16": {"enabled": True}, "bf16": {"enabled": False}}) == "fp16"
    assert engine_dtype({"train_micro_batch_size_per_gpu": 1}) == engine_dtype({"bf16": {"enabled": False}}) == "fp32"


def test_a_profile_runs_in_the_runs_precision_and_is_cached_apart(tmp_path):
    """bf16 weights are half fp32's bytes, and the two profiles never share a cache entry."""
    settings = ProfileSettings(warmup=0, repeats=1, cache_dir=str(tmp_path), progress=False)
    x = torch.randn(4, 64)
    fp32 = profile_layers([nn.Linear(64, 64)], x, settings=settings, device="cpu", dtype=torch.float32)
    bf16 = profile_layers([nn.Linear(64, 64)], x, settings=settings, device="cpu", dtype=torch.bfloat16)
    assert fp32[0].param_bytes == (64 * 64 + 64) * 4 and bf16[0].param_bytes == (64 * 64 + 64) * 2
    assert bf16[0].output_bytes == 4 * 64 * 2
    cached = sorted(p for p in tmp_path.rglob("*.json"))
    assert len(cached) == 2 and {json.loads(p.read_text())["key"]["dtype"] for p in cached} == \
        {"torch.float32", "torch.bfloat16"}


def test_the_drop_in_refuses_a_precision_the_engine_has_not():
    from ds_pipe_ext.partition import PartitionError
    from ds_pipe_ext.pipe.module import PipelineModule

    with pytest.raises(PartitionError, match=r"dtype='fp8': use one of \['bf16', 'fp16', 'fp32'\]"):
        PipelineModule([nn.Linear(2, 2)], num_stages=1, partition_method="uniform", dtype="fp8")


def test_a_gpu_profile_times_loops_and_takes_the_backward_as_their_difference():
    """The protocol's logic with a fake timer: the forward loop, the forward + backward loop, the checkpointed
    forward + backward loop, in that order; the backward and the replay are differences."""
    timed, calls = iter([0.002, 0.005, 0.0075]), []

    def fake_timer(fn):
        fn()  # one pass of the loop body: it must run as a function of nothing
        calls.append(fn)
        return next(timed)

    (cost,) = profile_layers([nn.Linear(8, 8)], torch.randn(4, 8), settings=QUICK, device="cpu", timer=fake_timer)
    assert len(calls) == 3
    assert cost.forward_s == 0.002 and cost.backward_s == pytest.approx(0.003) and cost.recompute_s == pytest.approx(0.0025)
    seen = []  # a timer reading the calls so far: the forward loop saw 1, forward + backward 3 (f, f, b)
    assert forward_backward_s(lambda: seen.append("f"), lambda out: seen.append("b"),
                              lambda fn: (fn(), len(seen))[1]) == (1, 2)
    assert seen == ["f", "f", "b"]


def test_the_cuda_spec_is_measured_once_per_device_and_versions_and_refused_without_cuda(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(AnalyticError, match="device 'cuda' is measured on a CUDA GPU, and this machine has none"):
        get_device("cuda", cache_dir=str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_spec, "cuda_spec_key", lambda: {"device": "NVIDIA H200", "torch": "2.11.0+cu130",
                                                             "cuda": "13.0", "tf32": False})
    measured, fields = [], {"matrix_flops": {"bf16": 7.9e14}, "vector_flops": {"bf16": 1e12}, "hbm_bandwidth": 4.3e12,
                            "memory_bytes": 1.4e11, "attention_efficiency": 0.6, "matrix_half_dim": 96.0}

    def measure():
        measured.append(1)
        return fields

    assert cuda_spec.measure_cuda(str(tmp_path), measure=measure) == ("NVIDIA H200", fields)
    assert cuda_spec.measure_cuda(str(tmp_path), measure=measure) == ("NVIDIA H200", fields)  # from the cache
    assert len(measured) == 1
    spec = get_device("cuda", cache_dir=str(tmp_path))  # the measured figures, the H200's links by its name
    assert (spec.name, spec.hbm_bandwidth, spec.matrix_half_dim) == ("cuda", 4.3e12, 96.0)
    assert spec.intra_node_bandwidth == DEVICES["h200"].intra_node_bandwidth
    assert spec.vector_flops == DEVICES["h200"].vector_flops  # the datasheet's: no torch op measures it
    (path,) = tmp_path.glob("cuda-spec-*.json")
    assert path.name == "cuda-spec-v2-NVIDIA-H200-torch2.11.0-cu130-cuda13.0-tf320.json"
    path.write_text("{not json")
    with pytest.raises(AnalyticError, match=f"{path}: not a cuda spec this version reads .* delete it"):
        cuda_spec.measure_cuda(str(tmp_path), measure=measure)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_dropout_mask_rule_is_what_a_cpu_dropout_saves(dtype):
    """On a CPU the mask has the input's dtype (4 bytes in fp32, 2 in bf16); CUDA's kernel keeps 1 byte."""
    x = torch.randn(64, 128, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dtype], requires_grad=True)
    saved, _ = saved_activation_bytes(lambda: nn.Dropout(0.1)(x), [])
    assert saved == x.numel() * dropout_mask_bytes("cpu", dtype)
    assert dropout_mask_bytes("cuda", dtype) == dropout_mask_bytes("h100", dtype) == 1


def test_a_tied_embedding_and_head_are_one_tensor_where_one_process_holds_both():
    tied, untied = model_shape(load_model_config("tiny-tied")), model_shape(load_model_config("tiny"))
    # tiny-tied: [embedding, 4 blocks, final norm, tied head]; the head calls the embedding's module
    assert len(tied.layer_numels) == len(untied.layer_numels) + 1
    assert tied.params == untied.params - 512 * 64  # untied, the head has its own vocabulary matrix


def test_a_datasheet_calibration_never_fits_past_what_the_gpu_reaches():
    """Layer times twice as fast as the H100 datasheet's peak would need an efficiency of ~2: the fit stops at
    the ceiling, 0.80 of the peak for GEMMs (cuBLAS's best bf16 matmul), 1.0 for the rest."""
    from ds_pipe_ext.costs.calibrate import calibrate, ceilings
    from ds_pipe_ext.costs.estimate import EstimateRequest, shape_for
    from ds_pipe_ext.costs import analytic as A

    h100 = DEVICES["h100-sxm"]
    shp = shape_for(load_model_config("gpt2-medium"), EstimateRequest(micro_batch=8, seq=1024, dtype="bf16"), h100)
    ops = A.transformer_block(shp)
    modelled = lambda d, back: sum(d.op_time(op, dtype="bf16", tp=1, backward=back)["time_s"] for op in ops)  # noqa: E731
    fitted = calibrate(h100, [(ops, modelled(h100, False) / 2, modelled(h100, True) / 2)], dtype="bf16")
    assert ceilings(h100)["matrix"] == 0.80 and fitted.matrix_efficiency <= 0.80
    assert max(fitted.vector_efficiency, fitted.memory_efficiency) <= 1.0 and fitted.attention_efficiency <= 0.75
    assert ceilings(get_device("cpu", cache_dir=None))["matrix"] == float("inf")  # a measured spec: its own peaks


@pytest.mark.parametrize("model, layers", [
    ("compare-cpu:dropout", (0, 1, 5)),  # GPT, attention written out, dropout masks: embedding, block, head + loss
    ("bench-cpu-llama", (0, 1, 17)),  # Llama: SDPA, SwiGLU, RMSNorm, rotary
    ("bench-cpu-moe", (1, 7, 13)),  # a dense block, a routed one (8 experts), the head
])
def test_the_analytic_layer_peak_is_what_a_cpu_forward_and_backward_holds(model, layers):
    """Each layer alone, one forward and backward on the CPU, its output's gradient made beforehand: the
    allocator's peak above resting (torch.profiler's allocation events) is the analytic ``peak_bytes`` within 5%:
    the backward's temporaries (dP and dV of the attention, SwiGLU's gradient beside its sigmoid, the residual
    gradient held across a branch) and the output held, without the input the layer was given."""
    from ds_pipe_ext.costs.layers import build_for_profiling
    from ds_pipe_ext.costs.probes import detach_input, tensors_of, traced_peak_bytes
    from ds_pipe_ext.models import family_of, load_model

    name, _, variant = model.partition(":")
    cfg = load_model(name)
    if variant == "dropout":
        cfg = replace(cfg, dropout=0.1)
    family = family_of(cfg)
    specs, loss = family.layer_specs(cfg), family.loss_fn(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    analytic = analytic_layer_costs(cfg, EstimateRequest(micro_batch=1, seq=cfg.seq_len, dtype="fp32"),
                                    get_device("cpu", cache_dir=None))
    x = tokens[:, :-1]
    for i, spec in enumerate(specs[:max(layers) + 1]):
        module, call = build_for_profiling(spec)
        last = i == len(specs) - 1
        forward = (lambda inp: loss(call(inp), tokens[:, 1:])) if last else call
        if i in layers:
            with torch.no_grad():
                seeds = [torch.ones_like(t) if t.dim() else None for t in tensors_of(forward(detach_input(x)))]

            def run():
                outs = [t for t in tensors_of(forward(detach_input(x))) if t.requires_grad]
                torch.autograd.backward(outs, seeds[:len(outs)])
                for p in module.parameters():
                    p.grad = None

            measured = traced_peak_bytes(run)
            assert analytic[i].peak_bytes == pytest.approx(measured, rel=0.05), (model, i, analytic[i].name)
        with torch.no_grad():
            x = call(detach_input(x))


def test_a_gpu_embedding_backward_in_16_bit_holds_an_fp32_table_beside_its_gradient():
    """Measured on an H200 (docs/gpu-runs/h200-2026-11-27/costs.log): the embedding's allocator peak in bf16 was
    4 x V x h bytes above the analytic count without it (gpt2-medium 316.5 vs 116.2 MiB, llama3-8b 3,038 vs
    1,034 MiB); a CPU, and fp32 anywhere, sum in place."""
    from ds_pipe_ext.costs.estimate import table_grad_accum_bytes

    assert [table_grad_accum_bytes(d, t) for d, t in (("cuda", "bf16"), ("h100", "fp16"), ("cpu", "bf16"),
                                                      ("cuda", "fp32"))] == [4, 4, 0, 0]
    from ds_pipe_ext.models import load_model

    cfg = load_model("llama3-8b")
    req = EstimateRequest(micro_batch=1, seq=4096, dtype="bf16")
    gpu = analytic_layer_costs(cfg, req, get_device("h200"))
    cpu = analytic_layer_costs(cfg, req, get_device("h200"), runs_on="cpu")
    table = cfg.vocab_size * cfg.hidden
    assert gpu[0].peak_bytes - cpu[0].peak_bytes == 4 * table == 2004 * 2**20
    assert [c.peak_bytes for c in gpu[1:-1]] == [c.peak_bytes for c in cpu[1:-1]]  # the embedding's backward
    # and the chunked head's loss: liger-kernel's on a GPU keeps the weight's gradient in bf16, not fp32
    assert cpu[-1].activation_bytes - gpu[-1].activation_bytes == 2 * cfg.padded_vocab * cfg.hidden


def test_a_gpu_chunked_head_keeps_what_liger_kernels_loss_keeps():
    """liger-kernel's fused linear cross-entropy (the ``[gpu]`` extra) accumulates the head weight's gradient in the
    weight's dtype (``accum_dtype`` None) and keeps it with the hidden states' for the backward: GPT-2 medium's bf16
    head at 8 x 1,024 tokens saved 130.2 MiB on an H200 (docs/gpu-runs/h200-2026-11-30/call2/layers-records.json):
    its norm's input, the two gradients; the CPU's own chunks keep the weight's in fp32."""
    from ds_pipe_ext.models import load_model

    cfg = load_model("gpt2-medium", tie_embeddings=False)
    req = EstimateRequest(micro_batch=8, seq=1024, dtype="bf16")
    gpu = analytic_layer_costs(cfg, req, get_device("h200"), runs_on="cuda")[-1]
    cpu = analytic_layer_costs(cfg, req, get_device("h200"), runs_on="cpu")[-1]
    tokens = 8 * 1024 * cfg.hidden * 2
    assert gpu.activation_bytes == 2 * tokens + cfg.padded_vocab * cfg.hidden * 2 == 130.25 * 2**20
    assert cpu.activation_bytes == 2 * tokens + cfg.padded_vocab * cfg.hidden * 4


def test_a_16_bit_pipeline_without_zero_holds_bf16_optimizer_states():
    """DeepSpeed runs a bf16 pipeline at ZeRO-0 with its BF16_Optimizer: bf16 weights and gradients, the
    fp32 cast of the gradients, a bf16 accumulation buffer, fp32 masters and moments.  The bytes a CPU launch
    of tiny-tied held (bench/gpu_path.py --cpu-dry-run's train part; on an H200 gpt2-medium's read +25% off the
    ZeRO-0 rule before)."""
    from ds_pipe_ext.compare.configs import CompareConfig
    from ds_pipe_ext.compare.predict import predicted_ranks
    from ds_pipe_ext.layout import Layout

    shape = model_shape(load_model_config("tiny-tied"))
    n = 234_880  # tiny-tied's parameters, the tied matrix once
    for zero, grads in ((0, 2 * n + 4 * n + 2 * n), (1, 4 * n)):
        cfg = CompareConfig("pp1", Layout(pp=1, dp=1, zero=zero, micro_batch=2, micro_batches=2, schedule="1f1b"),
                            "profiled")
        (rank,) = predicted_ranks(cfg, shape, [0.0] * len(shape.layer_numels), parts=[0, len(shape.layer_numels)],
                                  element_bytes=2)
        assert (rank["param_bytes"], rank["grad_bytes"], rank["optimizer_bytes"]) == (2 * n, grads, 12 * n)


def test_a_stage_holding_both_tied_ends_holds_their_weights_once():
    """On an H200 the report of a 1-stage bf16 gpt2-medium pipeline predicted 776.9 MiB of parameters where the
    rank held 676.8: the tied embedding and head counted as two modules.  DeepSpeed builds a TiedLayerSpec's
    module once a process, so one stage holding both holds it once; two stages hold a copy each."""
    from ds_pipe_ext.costs.stage import stage_costs
    from ds_pipe_ext.models.gpt import gpt_layer_specs, lm_loss

    cfg = load_model_config("tiny-tied")
    specs = gpt_layer_specs(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    costs = profile_layers(specs, tokens[:, :-1], labels=tokens[:, 1:], loss_fn=lm_loss, settings=QUICK)
    assert costs[0].tied_key == costs[-1].tied_key != "" and costs[-1].tied_param_bytes == costs[-1].param_bytes
    assert all(c.tied_key == "" for c in costs[1:-1])
    numels = sum(p.numel() for p in torch.nn.ModuleList(s.build() for s in specs[:-1]).parameters())  # the model
    n = len(costs)
    (one,) = stage_costs(costs, [0, n], micro_batches=2)
    assert one.param_bytes == one.grad_bytes == 4 * numels and one.optimizer_bytes == 8 * numels
    two = stage_costs(costs, [0, 3, n], micro_batches=2)
    assert sum(s.param_bytes for s in two) == 4 * numels + costs[-1].param_bytes  # the last stage's own copy
    # the analytic costs say the same of the word table
    analytic = analytic_layer_costs(cfg, EstimateRequest(micro_batch=2, seq=cfg.seq_len, dtype="fp32"),
                                    get_device("a100"), runs_on="cpu")
    (whole,) = stage_costs(analytic, [0, len(analytic)], micro_batches=2)
    table = cfg.vocab_size * cfg.hidden * 4
    assert whole.param_bytes == sum(c.param_bytes for c in analytic) - table


_SDPA = torch.nn.functional.scaled_dot_product_attention


class _KernelAsOnAGpu(torch.autograd.Function):
    """torch's attention kernels as a GPU runs them, on a CPU: each keeps q, k, v, its output and the
    log-sum-exp; the memory-efficient kernel allocates its output (b, s, heads, d) in memory, flash's and
    cuDNN's follow the query's order (``empty_like``)."""

    @staticmethod
    def forward(ctx, q, k, v, efficient):
        b, heads, s, d = q.shape
        out = (torch.empty(b, s, heads, d, dtype=q.dtype).transpose(1, 2) if efficient
               else torch.empty_like(q.transpose(1, 2)).transpose(1, 2))
        out.copy_(_SDPA(q, k, v, is_causal=True))
        ctx.save_for_backward(q, k, v, out, torch.empty(b, heads, s))
        return out

    @staticmethod
    def backward(ctx, grad):
        return None, None, None, None


@pytest.mark.parametrize("efficient", [True, False])
def test_a_memory_efficient_attention_output_costs_autograds_linear_a_copy(monkeypatch, efficient):
    """The GPT block's out projection is handed the attention output as an (s, b, h) view.  From the
    memory-efficient kernel's (b, s, heads, d) storage that view cannot be flattened: autograd's linear
    (torch.matmul) keeps a flattened copy beside the kernel's output, DeepSpeed ZeRO-3's linear keeps the view.
    The analytic count says the same on a GPU (fp32 selects the memory-efficient kernel, bf16 cuDNN)."""
    import torch.nn.functional as F
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    from ds_pipe_ext.costs.layers import build_for_profiling
    from ds_pipe_ext.instrument.memory import SavedActivationMeter
    from ds_pipe_ext.models import family_of, load_model

    cfg = load_model("tiny")
    b, s, dtype = 2, cfg.seq_len, "fp32" if efficient else "bf16"
    module, call = build_for_profiling(family_of(cfg).layer_specs(cfg)[1])
    module.to(torch.float32)
    module.attn.sdpa = True  # a CPU writes GPT attention out; a GPU runs SDPA
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: _KernelAsOnAGpu.apply(q, k, v, efficient))
    saved = {}
    for linear in ("autograd", "zero3"):
        if linear == "zero3":
            monkeypatch.setattr(F, "linear", zero3_linear_wrap)
        for selective in (False, True):  # selective recompute: the kernel keeps nothing, its output is the copy
            module.attn.selective_recompute = selective
            meter = SavedActivationMeter(module)
            with meter.forward(0):
                call(torch.randn(s, b, cfg.hidden, requires_grad=True))
            saved[linear, selective] = meter.peak
    copy = b * s * cfg.hidden * 4
    assert saved["autograd", False] - saved["zero3", False] == (copy if efficient else 0)
    assert saved["autograd", True] == saved["zero3", True]

    def analytic(**kw) -> float:
        req = EstimateRequest(micro_batch=b, seq=s, dtype=dtype, **kw)
        return analytic_layer_costs(cfg, req, get_device("h200"))[1].activation_bytes

    e = 4 if efficient else 2
    assert analytic() - analytic(zero3_linear=True) == (b * s * cfg.hidden * e if efficient else 0)
    # none where the linear keeps what it is handed (megatron-core's under TP, Megatron's kernels) or is traced
    # (compiled), and none on a CPU, whose attention writes its output in the query's order
    from ds_pipe_ext.costs.estimate import shape_for

    req = EstimateRequest(micro_batch=b, seq=s, dtype=dtype)
    assert shape_for(cfg, req, get_device("h200")).autograd_linear
    for other in ({"execution": "megatron"}, {"execution": "compiled"}, {"tp": 2}, {"zero3_linear": True},
                  {"selective_recompute": True}):
        assert not shape_for(cfg, replace(req, **other), get_device("h200")).autograd_linear
    assert not shape_for(cfg, req, get_device("h200"), runs_on="cpu").autograd_linear
