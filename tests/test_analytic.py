"""The analytic model against published formulas, and its CPU terms."""

import pytest

from ds_pipe_ext.costs import analytic as A
from ds_pipe_ext.costs import attention_ops
from ds_pipe_ext.costs import edge_ops as E
from ds_pipe_ext.costs.hardware import DEVICES

# GPT-3 175B shapes (Korthikanti et al. 2022, Table 3): a=96, h=12288, s=2048, 16-bit
G3 = dict(b=1, s=2048, h=12288, a=96, f=4 * 12288, V=51200, e=2, m=1)


def block_activation(selective=False, **kw):
    return A.total(A.transformer_block(A.Shape(**{**G3, **kw})), selective_recompute=selective).activation_bytes


@pytest.mark.parametrize("t", [1, 2, 8])
def test_korthikanti_table_2_all_five_rows(t):
    s, b, h, a = G3["s"], G3["b"], G3["h"], G3["a"]
    sbh = s * b * h
    if t == 1:
        assert block_activation() == sbh * (34 + 5 * a * s / h)  # no parallelism
        return
    assert block_activation(t=t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-12)
    assert block_activation(t=t, sp=True) == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)), rel=1e-12)
    assert block_activation(True, t=t) == pytest.approx(sbh * (10 + 24 / t), rel=1e-12)
    assert block_activation(True, t=t, sp=True) == pytest.approx(sbh * 34 / t, rel=1e-12)


def test_model_flops_match_narayanan():
    B, s, L, h, V = 4, 2048, 96, 12288, 51200
    shp = A.Shape(b=B, s=s, h=h, a=96, f=4 * h, V=V)
    matrix = lambda ops: sum(o.fwd_flops + o.bwd_flops for o in ops if o.kind != "vector")  # noqa: E731
    got = L * matrix(A.transformer_block(shp)) + matrix(E.lm_head(shp))
    assert got == pytest.approx(A.matmul_flops_per_iteration(B=B, s=s, L=L, h=h, V=V), rel=1e-12)


def test_tp_divides_matrix_work_and_adds_the_megatron_collectives():
    one, two = (A.total(A.transformer_block(A.Shape(**{**G3, "t": t}))) for t in (1, 2))
    assert two.fwd_flops < one.fwd_flops
    shp = A.Shape(**{**G3, "t": 2})
    # no SP: one all-reduce of b*s*h forward (out_proj, fc2) and backward (qkv, fc1) per half block
    assert two.comm_fwd_bytes == two.comm_bwd_bytes == 2 * shp.sbh * shp.e
    sp = A.total(A.transformer_block(A.Shape(**{**G3, "t": 2, "sp": True})))
    # SP replaces each all-reduce by an all-gather + reduce-scatter pair: the same ring bytes,
    # issued twice as collectives of half the cost each
    assert sp.comm_fwd_bytes == 2 * two.comm_fwd_bytes
    # and backward gathers the column-parallel inputs again for the weight gradients (megatron-core
    # keeps the shard only): per half block all-gather + reduce-scatter entering, all-gather leaving
    assert sp.comm_bwd_bytes == 3 * two.comm_bwd_bytes
    dev = DEVICES["a100-80gb"]
    qkv = next(o for o in A.transformer_block(A.Shape(**{**G3, "t": 2, "sp": True})) if o.comm_type.count(",") == 1)
    payload = shp.sbh * shp.e
    # each priced by NCCL's model on the device's DGX, the TP pair placed inside a node
    pair = dev.cluster.tp_placement(2)
    assert (pair.size, pair.nodes) == (2, 1)
    expected = sum(dev.group_time(k, payload, pair) for k in ("all-gather", "reduce-scatter"))
    assert dev.op_time(qkv, dtype="bf16", tp=2, backward=True)["comm_s"] == pytest.approx(expected)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(t=7), "does not divide heads"),
        (dict(sp=True), "needs tensor parallelism"),
        (dict(b=-1), "positive integers"),
        (dict(h=0), "positive integers"),
    ],
)
def test_bad_shapes_are_clear_errors(kw, match):
    with pytest.raises(A.AnalyticError, match=match):
        A.Shape(**{**G3, **kw})


def test_ring_collectives_and_roofline():
    from ds_pipe_ext.costs.device_spec import ring_time
    from ds_pipe_ext.costs.hardware import get_device

    assert ring_time(8e9, "all-reduce", 8, 1e9) == pytest.approx(2 * 7 / 8 * 8)
    assert ring_time(8e9, "all-gather", 8, 1e9) == pytest.approx(7 / 8 * 8)
    assert ring_time(8e9, "all-reduce", 1, 1e9) == 0.0
    from dataclasses import replace

    a100 = get_device("a100")
    op = A.linear("x", 4096, 4096, 4096, A.Shape(**G3))
    roofline = replace(a100, gpu=None)  # the class roofline (CPU specs, and a GPU spec without kernel figures)
    t = roofline.op_time(op, dtype="bf16", tp=1)
    assert t["time_s"] == max(t["compute_s"], t["memory_s"])
    assert t["compute_s"] == pytest.approx(2 * 4096**3 / (312e12 * a100.matrix_efficiency))
    # a GPU spec prices the GEMM as a kernel: its ceiling, its 32 x 16 tiles of 128 x 256 over 108 SMs
    # (512 tiles: 5 waves, 0.948 full) and its fill at K = 4,096
    kern = a100.gpu
    waves = 512 / (5 * 108)
    assert a100.op_time(op, dtype="bf16", tp=1)["time_s"] == pytest.approx(
        2 * 4096**3 / (312e12 * kern.gemm_efficiency * waves * 4096 / (4096 + kern.k_half)))
    with pytest.raises(A.AnalyticError, match="unknown device 'tpu'"):
        get_device("tpu")


def test_fresh_allocations_cost_page_faults_only_above_the_mmap_threshold():
    """A CPU's glibc maps blocks above its mmap threshold afresh on every allocation: the embedding's
    dense gradient table and the head's vocabulary-wide buffers pay page faults, the block's do not."""
    from dataclasses import replace

    from ds_pipe_ext.costs.hardware import get_device

    shp = A.Shape(b=4, s=256, h=512, a=8, f=2048, V=50257, e=4, m=4, dropout=False)
    gpu = get_device("a100")
    cpu = replace(gpu, fresh_page_bandwidth=1e9, fresh_alloc_min_bytes=32 * 2**20)
    table = 50257 * 512 * 4
    emb = E.embedding(shp)[0]
    assert emb.bwd_allocs == (table,)
    t = lambda dev, op, bwd: dev.op_time(op, dtype="fp32", tp=1, backward=bwd)["time_s"]  # noqa: E731
    assert t(cpu, emb, True) - t(gpu, emb, True) == pytest.approx(table / 1e9)
    # cross-entropy: log-probabilities forward; two vocabulary-wide gradients backward (fp32)
    xent = E.lm_head(shp)[-1]
    assert t(cpu, xent, True) - t(gpu, xent, True) == pytest.approx(2 * 1024 * 50257 * 4 / 1e9)
    # nothing a block allocates at this shape is above 32 MiB: no page faults
    assert all(t(cpu, op, bwd) == t(gpu, op, bwd) for op in A.transformer_block(shp) for bwd in (False, True))
    # the same op sums its allocations through OpCost addition
    assert A.total([emb, xent]).bwd_allocs == (table, 1024 * 50257 * 4, 1024 * 50257 * 4)


def test_the_embedding_gradient_is_one_write_only_pass_at_the_fill_rate():
    """The dense table gradient is zeroed (one write pass, at the device's fill rate) and the looked-up
    rows added: b 1 x s 128 tokens of h 512 fp32 read and written twice (2 x 0.25 MiB), the table
    (50257 x 512 x 4 = 102,926,336 bytes) written once.  At 20 GB/s for traffic and 10 GB/s for
    fills (memory efficiency 1): 524,288 / 20e9 + 102,926,336 / 10e9 s."""
    from dataclasses import replace

    from ds_pipe_ext.costs.hardware import get_device

    shp = A.Shape(b=1, s=128, h=512, a=8, f=2048, V=50257, e=4, m=4, dropout=False)
    emb = E.embedding(shp, positions=False)[0]
    assert emb.bwd_bytes == 2 * 128 * 512 * 4 + 102_926_336 and emb.bwd_fill_bytes == 102_926_336
    dev = replace(get_device("a100"), hbm_bandwidth=20e9, fill_bandwidth=10e9, memory_efficiency=1.0, gpu=None)
    assert dev.op_time(emb, dtype="fp32", tp=1, backward=True)["memory_s"] == pytest.approx(
        524_288 / 20e9 + 102_926_336 / 10e9, rel=1e-12)
    # no fill rate measured (a GPU's datasheet): fills run at the memory bandwidth
    plain = replace(dev, fill_bandwidth=0.0)
    assert plain.op_time(emb, dtype="fp32", tp=1, backward=True)["memory_s"] == pytest.approx(
        (524_288 + 102_926_336) / 20e9, rel=1e-12)


def test_a_cpu_backward_adds_each_weight_gradient_into_the_last_at_a_copys_time():
    """AccumulateGrad on the roofline: an op's weight gradients added into the previous micro-batch's (m - 1 of m
    micro-batches) at a copy's time, 2 x their bytes at the measured copy rate: the embedding's 50,257 x 512 fp32
    table at 20 GB/s, 2 x 102,926,336 / 20e9 s; none under Megatron's fused accumulation, none forward, none for an
    op without weights.  The backward's row adds run at their own measured rate, the forward's lookups at theirs."""
    from dataclasses import replace

    from ds_pipe_ext.costs.hardware import get_device

    shp = A.Shape(b=1, s=128, h=512, a=8, f=2048, V=50257, e=4, m=4, dropout=False)
    emb = E.embedding(shp, positions=False)[0]
    dev = replace(get_device("a100"), hbm_bandwidth=20e9, fill_bandwidth=10e9, memory_efficiency=1.0, gpu=None,
                  row_op_s=0.5e-6, row_add_s=1.5e-6)
    bwd = dev.op_time(emb, dtype="fp32", tp=1, backward=True)
    assert bwd["accumulate_s"] == pytest.approx(2 * 102_926_336 / 20e9, rel=1e-12)
    assert bwd["time_s"] == pytest.approx(bwd["memory_s"] + bwd["accumulate_s"] + 128 * 1.5e-6, rel=1e-12)
    fwd = dev.op_time(emb, dtype="fp32", tp=1)
    assert fwd["accumulate_s"] == 0.0 and fwd["random_s"] == pytest.approx(128 * 0.5e-6)
    assert dev.op_time(emb, dtype="fp32", tp=1, backward=True, execution="megatron")["accumulate_s"] == 0.0
    softmax = next(op for op in A.transformer_block(shp) if not op.weights)
    assert dev.op_time(softmax, dtype="fp32", tp=1, backward=True)["accumulate_s"] == 0.0
    # a GPU spec prices it among its kernels (gpu_pricing.grad_accumulate_s), not on the roofline
    assert get_device("h100").op_time(emb, dtype="bf16", tp=1, backward=True)["accumulate_s"] == 0.0


def test_a_measured_add_rate_prices_the_accumulation_and_the_in_place_sums():
    """A spec that timed add_ itself (``add_bandwidth``, counted as a copy's two bytes a byte) prices autograd's
    accumulation and MTP's in-place sum of the shifted lookups' tables at that rate, the rest of the op's bytes at
    the copy's: the embedding's accumulation 2 x 102,926,336 / 25e9 s; mtp_lookups' backward of depth 1 moves its
    output gradient and the fresh table at the copy rate, zeroes the table at the fill rate and adds it in place
    (3 x the table's bytes moved, timed as 2 x at the add rate)."""
    from dataclasses import replace

    from ds_pipe_ext.costs.hardware import get_device

    shp = A.Shape(b=1, s=128, h=512, a=8, f=2048, V=50257, e=4, m=4, dropout=False)
    emb = E.embedding(shp, positions=False)[0]
    dev = replace(get_device("a100"), hbm_bandwidth=20e9, fill_bandwidth=10e9, add_bandwidth=25e9,
                  memory_efficiency=1.0, gpu=None)
    assert dev.op_time(emb, dtype="fp32", tp=1, backward=True)["accumulate_s"] == pytest.approx(
        2 * 102_926_336 / 25e9, rel=1e-12)
    table = 102_926_336
    lookups = attention_ops.mtp_lookups(shp, 1)
    assert (lookups.bwd_bytes, lookups.bwd_fill_bytes, lookups.bwd_inplace_bytes) == (
        2 * 128 * 512 * 4 + 4 * table, table, 3 * table)
    assert dev.op_time(lookups, dtype="fp32", tp=1, backward=True)["memory_s"] == pytest.approx(
        2 * 128 * 512 * 4 / 20e9 + table / 10e9 + 2 * table / 25e9, rel=1e-12)
    # without a measured add rate, a copy's
    assert replace(dev, add_bandwidth=0.0).op_time(lookups, dtype="fp32", tp=1, backward=True)["memory_s"] == \
        pytest.approx(2 * 128 * 512 * 4 / 20e9 + table / 10e9 + 2 * table / 20e9, rel=1e-12)


def test_a_cpu_draws_each_dropout_mask_element_at_its_measured_rate():
    """Dropout over b 2 x s 128 x h 512 = 131,072 elements draws as many random numbers forward: at
    1e8 draws/s that is 1.31 ms on top of the roofline; backward only applies the saved mask; a
    device with no measured rate (a GPU: drawn in the fused kernel) adds nothing."""
    from dataclasses import replace

    from ds_pipe_ext.costs.hardware import get_device

    shp = A.Shape(b=2, s=128, h=512, a=8, f=2048, V=50257, e=4, m=4, dropout=True)
    op = A.dropout("mlp_dropout", shp.replicated_sbh, shp)
    gpu = get_device("a100")
    cpu = replace(gpu, random_rate=1e8)
    t = lambda dev, bwd: dev.op_time(op, dtype="fp32", tp=1, backward=bwd)  # noqa: E731
    assert t(cpu, False)["random_s"] == pytest.approx(131_072 / 1e8, rel=1e-12)
    assert t(cpu, False)["time_s"] - t(gpu, False)["time_s"] == pytest.approx(131_072 / 1e8, rel=1e-12)
    assert t(cpu, True)["time_s"] == t(gpu, True)["time_s"] and t(gpu, False)["random_s"] == 0.0


def test_estimate_cli_gpt3_175b_tp8_sp(capsys):
    import json

    from ds_pipe_ext.cli import main

    assert main(["estimate", "--model", "gpt3-175b", "--tp", "8", "--sp", "--device", "a100",
                 "--micro-batch", "1", "--seq", "2048", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    blocks = [layer for layer in out["layers"] if layer["kind"] == "block"]
    assert len(blocks) == 96 and out["layers"][0]["kind"] == "embedding" and out["layers"][-1]["kind"] == "head"
    assert all(layer["activation_bytes"] == 34 * s * b * h / t + 5 * a * s * s * b / t for layer in blocks)
    assert {"name", "kind", "fwd_flops", "bwd_flops", "activation_bytes", "param_bytes", "fwd_s", "bwd_s"} <= set(blocks[0])
    assert main(["estimate", "--model", "gpt3-175b", "--tp", "7"]) == 2
    assert "does not divide heads" in capsys.readouterr().err


@pytest.mark.parametrize("dropout, b", [(0.0, 1), (0.1, 2)])
def test_analytic_activations_match_what_autograd_saves_on_cpu(dropout, b):
    """TP=1, fp32 on CPU: every layer type within 3% of the saved-tensor hooks' count."""
    import torch

    from ds_pipe_ext.costs.estimate import EstimateRequest, estimate_layers
    from ds_pipe_ext.costs.hardware import DeviceSpec
    from ds_pipe_ext.costs.profiler import ProfileSettings, profile_layers
    from ds_pipe_ext.models.gpt_config import GPTConfig, load_model_config
    from ds_pipe_ext.models.gpt import gpt_layer_specs, lm_loss

    cfg = GPTConfig.from_dict({**load_model_config("bench-cpu").to_dict(), "seq_len": 128, "vocab_size": 8192,
                               "dropout": dropout}, name="probe")
    specs = gpt_layer_specs(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    measured = profile_layers([specs[0], specs[1], specs[-1]], tokens[:, :-1], labels=tokens[:, 1:], loss_fn=lm_loss,
                              settings=ProfileSettings(cache_dir=None, warmup=0, repeats=1, progress=False))
    cpu = DeviceSpec("cpu", {"fp32": 1e11}, {"fp32": 1e10}, 1e10, 1e10, 1e10, 2**34, gpus_per_node=1)
    est = estimate_layers(cfg, EstimateRequest(b, cfg.seq_len, dtype="fp32"), cpu)
    for got, want in zip([est[0], est[1], est[-1]], measured):
        assert got["activation_bytes"] == pytest.approx(want.activation_bytes, rel=0.03), got["name"]


def test_rank_memory_follows_deepspeeds_zero_rules_per_tensor():
    from ds_pipe_ext.costs.types import LayerCost
    from ds_pipe_ext.costs.zero import rank_memory

    # bf16: two layers of 50 parameters (100 bytes) each, counted as one tensor a layer; dp 4
    layers = [LayerCost(f"l{i}", 1.0, 2.0, param_bytes=100) for i in range(2)]
    z = {k: rank_memory(layers, activation_bytes=40, zero=k, dp=4, element_bytes=2) for k in (0, 1, 2, 3)}
    kinds = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "gathered_bytes")
    # ZeRO-0: 2 + (2 + 4 fp32 copy) + (8 + 4 master) bytes a parameter, 100 parameters
    assert [getattr(z[0], k) for k in kinds] == [200, 600, 1200, 40, 0]
    # ZeRO-1/2: 100 padded to 104 (a multiple of 2 dp), all of it in bf16; a 26-element partition of
    # fp32 gradient and master + moments
    assert [getattr(z[1], k) for k in kinds] == [208, 104, 312, 40, 0]
    assert [getattr(z[2], k) for k in kinds] == [208, 104, 312, 40, 0]
    # ZeRO-3: each tensor padded to a multiple of dp: 13 + 13 elements; bf16 + fp32 gradient partitions;
    # the layer computed and the one prefetched gathered whole: 2 x 50 x 2 bytes
    assert [getattr(z[3], k) for k in kinds] == [52, 156, 312, 40, 200]
    assert z[1].total_bytes == 208 + 104 + 312 + 40
    # with its tensors known (45 + 5 elements a layer) ZeRO-3 pads each: 12 + 2 = 14 a layer, not 13
    split = [LayerCost(f"l{i}", 1.0, 2.0, param_bytes=100, param_numels=(45, 5)) for i in range(2)]
    z3 = rank_memory(split, activation_bytes=0, zero=3, dp=4, element_bytes=2)
    assert (z3.param_bytes, z3.optimizer_bytes, z3.gathered_bytes) == (2 * 28, 12 * 28, 200)
    # offload: optimizer states (and ZeRO-3's parameter partitions) live in host memory
    off = rank_memory(split, activation_bytes=0, zero=3, dp=4, element_bytes=2, offload=True)
    assert (off.param_bytes, off.grad_bytes, off.optimizer_bytes) == (0, 6 * 28, 0)


def test_analytic_layer_tensors_are_the_modules_parameters():
    """The description's tensors (``LayerCost.param_numels``, ZeRO's per-tensor padding) are the GPT's own."""
    import torch

    from ds_pipe_ext.costs.estimate import EstimateRequest, analytic_layer_costs
    from ds_pipe_ext.costs.hardware import get_device
    from ds_pipe_ext.models import load_model
    from ds_pipe_ext.models.gpt import gpt_layer_specs

    cfg = load_model("tiny")
    assert not cfg.tie_embeddings
    costs = analytic_layer_costs(cfg, EstimateRequest(micro_batch=1, seq=cfg.seq_len, dtype="fp32"), get_device("a100"))
    with torch.device("meta"):
        layers = [spec.build() for spec in gpt_layer_specs(cfg)]
    assert [sorted(c.param_numels) for c in costs] == [sorted(p.numel() for p in m.parameters()) for m in layers]
    assert all(c.param_bytes == 4 * sum(c.param_numels) for c in costs)


def test_calibration_recovers_the_factors_that_made_the_times():
    """Times made by a known spec (GEMMs and per-head matmuls at one factor, page faults slowed with the
    memory system) are fitted back by the CPU calibration's three factors, within its grid's step."""
    from dataclasses import replace

    from ds_pipe_ext.costs.calibrate import calibrate
    from ds_pipe_ext.costs.hardware import DeviceSpec

    spec = DeviceSpec("cpu", {"fp32": 40e9}, {"fp32": 2.5e9}, 20e9, 20e9, 20e9, 24 * 2**30, gpus_per_node=1,
                      matrix_efficiency=1.0, attention_efficiency=1.0, vector_efficiency=1.0, memory_efficiency=1.0,
                      fresh_page_bandwidth=1e9)
    truth = replace(spec, matrix_efficiency=0.6, attention_efficiency=0.6, vector_efficiency=0.3,
                    memory_efficiency=0.7, fresh_page_bandwidth=0.7e9)
    layers = []
    for b, s in ((1, 64), (3, 192), (6, 96)):
        shp = A.Shape(b=b, s=s, h=512, a=8, f=2048, V=50257, e=4, m=4, dropout=False)
        for ops in (E.embedding(shp), A.transformer_block(shp), E.lm_head(shp)):
            f, bw = (sum(truth.op_time(op, dtype="fp32", tp=1, backward=k)["time_s"] for op in ops) for k in (0, 1))
            layers.append((ops, f, bw))
    fitted = calibrate(spec, layers, dtype="fp32", fit=("matrix", "vector", "memory"), attention_as_matrix=True)
    assert fitted.matrix_efficiency == fitted.attention_efficiency == pytest.approx(0.6, rel=0.1)
    assert fitted.vector_efficiency == pytest.approx(0.3, rel=0.1)
    assert fitted.memory_efficiency == pytest.approx(0.7, rel=0.1)
    assert fitted.fresh_page_bandwidth == pytest.approx(0.7e9, rel=0.1)
    with pytest.raises(ValueError, match="cannot fit"):
        calibrate(spec, layers, dtype="fp32", fit=("gemm",))


def test_the_cpu_calibration_fits_the_rate_an_embedding_zeroes_its_table_at():
    """A measured spec zeroes at 10 GB/s; an embedding backward that is one zeroing of a 1 GB table
    (nothing else) measured at 0.125 s says 8 GB/s, which fit_device takes, on the grid's step."""
    from dataclasses import replace

    from ds_pipe_ext.costs.calibrate import fit_device
    from ds_pipe_ext.costs.hardware import DeviceSpec

    spec = DeviceSpec("cpu", {"fp32": 40e9}, {"fp32": 2.5e9}, 20e9, 20e9, 20e9, 24 * 2**30, gpus_per_node=1,
                      matrix_efficiency=1.0, attention_efficiency=1.0, vector_efficiency=1.0, memory_efficiency=1.0,
                      fill_bandwidth=10e9)
    table = A.OpCost("word_embedding", "vector", bwd_bytes=1e9, bwd_fill_bytes=1e9)
    fitted = fit_device(spec, [([table], 0.0, 0.125)], dtype="fp32")
    assert fitted.fill_bandwidth == pytest.approx(8e9, rel=0.01)
    # a spec with no fill rate of its own (a GPU's, at the memory bandwidth) keeps it
    assert fit_device(replace(spec, fill_bandwidth=0.0), [([table], 0.0, 0.125)], dtype="fp32").fill_bandwidth == 0.0


def test_a_calibrated_cpu_spec_still_prices_what_runs_on_the_cpu():
    """The fitted spec keeps its name: the shape it prices has the CPU's float dropout masks and dense window
    masks, not a GPU's (a calibrated "cpu" was once renamed, and every check of the name read it as a GPU)."""
    from ds_pipe_ext.costs.calibrate import fit_device
    from ds_pipe_ext.costs.estimate import EstimateRequest, shape_for
    from ds_pipe_ext.costs.hardware import DeviceSpec
    from ds_pipe_ext.models import load_model

    spec = DeviceSpec("cpu", {"fp32": 40e9}, {"fp32": 2.5e9}, 20e9, 20e9, 20e9, 24 * 2**30, gpus_per_node=1,
                      matrix_efficiency=1.0, attention_efficiency=1.0, vector_efficiency=1.0, memory_efficiency=1.0)
    gemm = A.OpCost("fc1", "matrix", fwd_flops=4e9, bwd_flops=8e9)
    fitted = fit_device(spec, [([gemm], 0.2, 0.4)], dtype="fp32")
    assert fitted.name == "cpu" and fitted.matrix_efficiency == pytest.approx(0.5, rel=0.1)
    cfg, req = load_model("tiny"), EstimateRequest(1, 32, dtype="fp32")
    assert shape_for(cfg, req, fitted) == shape_for(cfg, req, spec)
    assert shape_for(cfg, req, fitted).m == 4 and shape_for(cfg, req, fitted).dense_window_mask


def test_a_cpu_prices_exponentials_at_its_measured_rate():
    """An op's exps at the spec's exp rate beside its FLOPs; not where the spec measured none (a GPU's)."""
    from dataclasses import replace

    from ds_pipe_ext.costs.hardware import DeviceSpec

    spec = DeviceSpec("cpu", {"fp32": 40e9}, {"fp32": 2e9}, 20e9, 20e9, 20e9, 24 * 2**30, gpus_per_node=1,
                      matrix_efficiency=1.0, attention_efficiency=1.0, vector_efficiency=1.0, memory_efficiency=1.0,
                      exp_rate=1e9)
    silu = A.OpCost("silu", "vector", fwd_flops=2e6, bwd_flops=4e6, fwd_exps=1e6, bwd_exps=1e6)
    assert spec.op_time(silu, dtype="fp32", tp=1)["compute_s"] == pytest.approx(1e-3 + 1e-3)
    assert spec.op_time(silu, dtype="fp32", tp=1, backward=True)["compute_s"] == pytest.approx(2e-3 + 1e-3)
    plain = replace(spec, exp_rate=0.0)
    assert plain.op_time(silu, dtype="fp32", tp=1)["compute_s"] == pytest.approx(1e-3)


def test_a_cpu_adds_each_ops_host_dispatch_in_series():
    """On a CPU the host issues an op's kernels on the core that runs them: kernels x the measured host time, on
    top of the roofline, forward and backward apart; nothing when compiled, or on a GPU spec (which prices its
    host against its kernels instead)."""
    from dataclasses import replace

    from ds_pipe_ext.costs.hardware import DeviceSpec, get_device

    spec = DeviceSpec("cpu", {"fp32": 40e9}, {"fp32": 2e9}, 20e9, 20e9, 20e9, 24 * 2**30, gpus_per_node=1,
                      matrix_efficiency=1.0, attention_efficiency=1.0, vector_efficiency=1.0, memory_efficiency=1.0,
                      host_op_s=1e-6, host_op_bwd_s=2e-6)
    gating = A.OpCost("gating", "vector", fwd_flops=2e6, bwd_flops=4e6, kernels=(30, 15))
    fwd, bwd = (spec.op_time(gating, dtype="fp32", tp=1, backward=b) for b in (False, True))
    assert (fwd["host_s"], fwd["time_s"]) == (pytest.approx(30e-6), pytest.approx(1e-3 + 30e-6))
    assert (bwd["host_s"], bwd["time_s"]) == (pytest.approx(30e-6), pytest.approx(2e-3 + 30e-6))
    assert spec.op_time(gating, dtype="fp32", tp=1, execution="compiled")["host_s"] == 0.0
    assert replace(spec, host_op_s=0.0).op_time(gating, dtype="fp32", tp=1)["time_s"] == pytest.approx(1e-3)
    assert get_device("h200").op_time(gating, dtype="bf16", tp=1)["host_s"] == 0.0


def test_deepspeeds_gates_are_counted_by_the_gate_that_runs():
    """DeepSpeed's TopKGate runs top1gating, top2gating or topkgating by its k; our gates (models.routers) run
    topkgating after their own ops, whatever k."""
    from ds_pipe_ext.arch import Experts
    from ds_pipe_ext.costs.moe_ops import GATING_KERNELS, ROUTER_KERNELS, gating_kernels

    assert [gating_kernels(Experts(8, k)) for k in (1, 2, 4)] == [GATING_KERNELS[1], GATING_KERNELS[2],
                                                                  GATING_KERNELS["k"]]
    sigmoid = gating_kernels(Experts(16, 2, router="sigmoid", groups=4, topk_groups=2))
    assert sigmoid == tuple(a + b for a, b in zip(GATING_KERNELS["k"], ROUTER_KERNELS["sigmoid"]))
    assert gating_kernels(Experts(8, 1, router_bias=True)) == tuple(
        a + b for a, b in zip(GATING_KERNELS["k"], ROUTER_KERNELS["bias"]))
