"""Each op priced as a GPU runs it (costs.gpu_pricing), the kernel tables (costs.kernel_table), and the two
benches around them: bench/gpu_kernels.py's CPU dry run and bench/gpu_fidelity.py on a small fixture."""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from ds_pipe_ext.arch import attention_backend
from ds_pipe_ext.costs import analytic as A
from ds_pipe_ext.costs import gpu_pricing as G
from ds_pipe_ext.costs.estimate import EstimateRequest, estimate_layers, op_rows, shape_for
from ds_pipe_ext.costs.layer_ops import layer_ops
from ds_pipe_ext.costs.hardware import datasheet_name, get_device
from ds_pipe_ext.costs.kernel_table import KernelTable, load_kernel_table, table_note
from ds_pipe_ext.costs.op_cost import AnalyticError
from ds_pipe_ext.models.registry import load_model

ROOT = Path(__file__).resolve().parents[1]


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _gemm_rate(spec, m: int, k: int, n: int, *, backward: bool = False, execution: str = "eager") -> float:
    op = A.linear("x", m, k, n, A.Shape(b=1, s=m, h=k, a=1, f=4, V=n), bias=False)
    flops = op.bwd_flops if backward else op.fwd_flops
    return flops / G.gemm_s(op, dtype="bf16", backward=backward, spec=spec, execution=execution)


def test_alignment_bytes_is_the_largest_power_of_two_of_every_width():
    assert G.alignment_bytes(1024, 50304, elem=2) == 16
    assert G.alignment_bytes(1024, 50257, elem=2) == 2  # odd: 2-byte rows
    assert G.alignment_bytes(4096, 10922, elem=2) == 4  # 2 x 5,461
    assert G.alignment_bytes(4096, 10944, elem=2) == 16
    assert G.alignment_bytes(1024, 50257, elem=4) == 4


def test_gpt2s_odd_vocabulary_prices_far_below_its_padded_twin():
    """50,257 wide (GPT-2's vocabulary) against 50,304 (nanoGPT's pad): the same tiles, the slower path."""
    h100 = get_device("h100")
    odd, padded = _gemm_rate(h100, 8192, 1024, 50257), _gemm_rate(h100, 8192, 1024, 50304)
    assert odd / padded == pytest.approx(h100.gpu.alignment_fwd[2], rel=0.02)
    assert _gemm_rate(h100, 8192, 1024, 50257, backward=True) / _gemm_rate(h100, 8192, 1024, 50304, backward=True) \
        == pytest.approx(h100.gpu.alignment_bwd[2], rel=0.02)
    # compiled, inductor pads the GEMM (to 50,264): about the padded twin's speed
    assert _gemm_rate(h100, 8192, 1024, 50257, execution="compiled") == pytest.approx(padded, rel=2e-3)


def test_a_swiglu_width_of_10922_runs_at_its_published_share_of_10944():
    """stas00/ml-engineering: 273 TFLOP/s at 10,922 against 398 at 10,944 on an H100; the two widths make the
    same tile count, so only alignment tells them apart."""
    h100 = get_device("h100")
    ratio = _gemm_rate(h100, 8192, 4096, 10922) / _gemm_rate(h100, 8192, 4096, 10944)
    assert ratio == pytest.approx(273 / 398, rel=0.01)


def test_wave_quantization_over_the_sms():
    kern = get_device("h100").gpu  # 132 SMs, 128 x 256 tiles
    assert G.wave_efficiency(128 * 12, 256 * 11, kern) == pytest.approx(1.0)  # 132 tiles: one full wave
    assert G.wave_efficiency(128 * 12, 256 * 11 + 1, kern) == pytest.approx(144 / 264)  # 144 tiles: 2 waves


def test_fp32_without_tf32_runs_on_cuda_cores_unpenalised_by_alignment():
    h200 = get_device("h200")
    simt = replace(h200, gpu=replace(h200.gpu, tf32=False))
    op = A.linear("x", 8192, 1024, 50257, A.Shape(b=1, s=8192, h=1024, a=1, f=4, V=50257, e=4), bias=False)
    t = G.gemm_s(op, dtype="fp32", backward=False, spec=simt)
    assert t == pytest.approx(op.fwd_flops / (h200.vector_flops["fp32"] * simt.gpu.gemm_efficiency
                                              * G.wave_efficiency(8192, 50257, simt.gpu)))


@pytest.mark.parametrize("kernel, device, kw, backend", [
    ("fused", "h100-sxm", dict(dtype="bf16", head_dim=64), "cudnn"),
    ("fused", "h100-sxm", dict(dtype="bf16", head_dim=128, gqa=True), "flash"),
    # a window runs flex_attention's block mask on a GPU (models.llama): SDPA with a dense mask would fall to
    # math under grouped-query heads, to memory-efficient without
    ("fused", "h100-sxm", dict(dtype="bf16", head_dim=128, gqa=True, masked=True), "flex"),
    ("fused", "h100-sxm", dict(dtype="bf16", head_dim=64, masked=True), "flex"),
    ("fused", "h100-sxm", dict(dtype="fp32", head_dim=64), "efficient"),
    ("auto", "cpu", dict(dtype="fp32"), "eager"),
    ("fused", "cpu", dict(dtype="fp32"), "cpu"),
    ("eager", "h200", dict(dtype="bf16"), "eager"),
], ids=["gpt", "llama-gqa", "windowed-gqa", "windowed", "fp32", "cpu-auto", "cpu-sdpa", "written-out"])
def test_the_attention_backend_selector(kernel, device, kw, backend):
    assert attention_backend(kernel, device, **kw) == backend


def test_attention_is_priced_as_the_selector_selects(monkeypatch):
    """Llama 3 8B's block (grouped-query) prices flash; the same op priced on another backend moves by that
    backend's share, and patching the selector moves the layer's price with it."""
    import ds_pipe_ext.costs.estimate as E

    h100 = get_device("h100")
    cfg = load_model("llama3-8b")
    req = EstimateRequest(micro_batch=1, seq=4096, dtype="bf16")
    shp = shape_for(cfg, req, h100)
    ops = layer_ops(cfg, shp, device=h100.name)[1][2]
    core = next(op for op in ops if op.name == "fused_attention")
    assert E.op_backend(core, req, h100.name) == "flash"
    row = next(r for r in op_rows(ops, h100, req) if r["op"] == "fused_attention")
    assert row["fwd_s"] == pytest.approx(G.attention_s(core, dtype="bf16", backward=False, spec=h100, backend="flash"))
    flash, cudnn = h100.gpu.attention["flash"][128][0], h100.gpu.attention["cudnn"][128][0]
    monkeypatch.setattr(E, "attention_backend", lambda *a, **k: "cudnn")
    patched = next(r for r in op_rows(ops, h100, req) if r["op"] == "fused_attention")
    assert patched["fwd_s"] == pytest.approx(row["fwd_s"] * flash / cudnn)


def test_an_eager_layer_takes_at_least_its_hosts_dispatch_and_compiled_drops_it():
    h200 = get_device("h200")
    cfg = load_model("tiny")
    eager = estimate_layers(cfg, EstimateRequest(micro_batch=1, seq=32, dtype="bf16"), h200)[1]
    compiled = estimate_layers(cfg, EstimateRequest(micro_batch=1, seq=32, dtype="bf16", execution="compiled"), h200)[1]
    assert eager["fwd_s"] >= eager["host_fwd_s"] > 0 and compiled["host_fwd_s"] == 0
    assert compiled["fwd_s"] < eager["fwd_s"]
    with pytest.raises(AnalyticError, match="execution 'jit'"):
        estimate_layers(cfg, EstimateRequest(micro_batch=1, seq=32, dtype="bf16", execution="jit"), h200)


def test_a_tied_head_stays_eager_when_the_layers_are_compiled():
    """train.compile compiles each layer's module; a tied head runs as the embedding's forward_fn and the loss
    outside the layers, so both keep their eager price (gpt2-medium ties its head, gpt3-1.3b does not)."""
    h200 = get_device("h200")
    for name, tied in (("gpt2-medium", True), ("gpt3-1.3b", False)):
        cfg = load_model(name)
        b, s = 1, 1024
        eager = estimate_layers(cfg, EstimateRequest(micro_batch=b, seq=s), h200)[-1]
        compiled = estimate_layers(cfg, EstimateRequest(micro_batch=b, seq=s, execution="compiled"), h200)[-1]
        assert (compiled["fwd_s"] == pytest.approx(eager["fwd_s"])) is tied


def _table(**extra) -> dict:
    return {"device": "h100-sxm", "source": "a test table",
            "gemm": [{"dtype": "bf16", "m": 1024, "k": 1024, "n": 1024, "seconds": 2 * 1024**3 / 400e12},
                     {"dtype": "bf16", "m": 4096, "k": 4096, "n": 4096, "seconds": 2 * 4096**3 / 700e12}],
            "attention": [{"backend": "flash", "dtype": "bf16", "s": 1024, "d": 128, "fwd_s": 1e-3, "bwd_s": 2e-3,
                           "fwd_flops": 2e11},
                          {"backend": "flash", "dtype": "bf16", "s": 4096, "d": 128, "fwd_s": 1e-3, "bwd_s": 2e-3,
                           "fwd_flops": 4e11}], **extra}


def test_a_kernel_table_interpolates_between_its_measured_shapes():
    table = KernelTable.from_json(_table())
    assert table.gemm_flops(1024, 1024, 1024, "bf16", 16) == (pytest.approx(400e12), True)
    rate, exact = table.gemm_flops(2048, 2048, 2048, "bf16", 16)
    assert 400e12 < rate < 700e12 and exact
    # no measured row of this alignment: the aligned rows', for the rule's factor to apply
    assert table.gemm_flops(1024, 1024, 1023, "bf16", 2)[1] is False
    assert table.gemm_flops(1024, 1024, 1024, "fp32", 16) is None
    # with the rule as a prior, the measured rates' ratio to it is what is interpolated: rows at half the prior's
    # rate price every shape between them at half the prior's rate there
    half = {"dtype": "bf16", "align": 16}
    prior = lambda m, k, n: 1e12 * (m * k * n) ** (1 / 3)  # noqa: E731
    rows = [{"dtype": "bf16", "m": s, "k": s, "n": s, "seconds": 2.0 * s ** 3 / (0.5 * prior(s, s, s))} for s in (512, 4096)]
    guided = KernelTable(device="h100-sxm", source="test", gemm=rows)
    assert guided.gemm_flops(1024, 2048, 1536, **half, prior=prior)[0] == pytest.approx(0.5 * prior(1024, 2048, 1536))
    # attention over the sequence (log-linear between 1,024 and 4,096)
    assert table.attention_flops("flash", "bf16", s=2048, d=128, backward=False) == pytest.approx((2e14 * 4e14) ** 0.5)
    assert table.attention_flops("cudnn", "bf16", s=2048, d=128, backward=False) is None


def test_attention_with_dropout_prices_from_the_tables_dropout_rows_else_by_its_share():
    """gpt2-medium's core (attention dropout 0.1): a table that measured the backend with dropout prices it from
    those rows; one measured without prices the plain rate at the spec's dropout share."""
    rows = _table()["attention"]
    slower = [{**r, "dropout": 0.1, "fwd_s": 2 * r["fwd_s"], "bwd_s": 2 * r["bwd_s"]} for r in rows]
    table = KernelTable.from_json(_table(attention=rows + slower))
    plain = table.attention_flops("flash", "bf16", s=2048, d=128, backward=False)
    assert table.attention_flops("flash", "bf16", s=2048, d=128, backward=False, dropout=True) == pytest.approx(plain / 2)
    assert KernelTable.from_json(_table()).attention_flops("flash", "bf16", s=2048, d=128, backward=False,
                                                           dropout=True) is None
    h100 = get_device("h100")
    cfg = load_model("gpt2-medium")
    req = EstimateRequest(micro_batch=8, seq=1024, dtype="bf16")
    core = next(op for op in layer_ops(cfg, shape_for(cfg, req, h100), device=h100.name)[1][2]
                if op.name == "fused_attention")
    assert core.attn_shape.dropout  # the model's dropout reaches the op
    no_dropout = replace(core, attn_shape=core.attn_shape._replace(dropout=0))
    measured = replace(h100, gpu=G.gpu_kernels("h100-sxm", table=table))
    unmeasured = replace(h100, gpu=G.gpu_kernels("h100-sxm", table=KernelTable.from_json(_table())))
    for backward in (False, True):
        price = lambda op, spec: G.attention_s(op, dtype="bf16", backward=backward, spec=spec, backend="flash")  # noqa: E731
        assert price(core, measured) == pytest.approx(2 * price(no_dropout, measured))
        assert price(core, unmeasured) == pytest.approx(price(no_dropout, unmeasured) / h100.gpu.attention_dropout)


def test_a_device_prices_from_its_table_where_there_is_one(tmp_path):
    """Without a table the rules price it, and estimate / plan say so; a table in the package's kernels/ is
    read for that device (its GEMM rates used as measured); a malformed one is an error naming the fix."""
    h100 = get_device("h100")
    assert h100.gpu.table is None and "priced by rules" in table_note(h100)
    (tmp_path / "h100-sxm.json").write_text(json.dumps(_table(launch_s=3e-6)))
    table = load_kernel_table("h100-sxm", tmp_path)
    measured = replace(h100, gpu=G.gpu_kernels("h100-sxm", table=table))
    assert measured.gpu.launch_s == 3e-6 and "a test table" in table_note(measured)
    assert _gemm_rate(measured, 1024, 1024, 1024) == pytest.approx(400e12)
    (tmp_path / "h200.json").write_text('{"device": "h200", "gemm": [{"dtype": "bf16"}]}')
    with pytest.raises(AnalyticError, match="not a kernel table.*gpu_kernels.py"):
        load_kernel_table("h200", tmp_path)


def test_datasheet_name_tells_the_h100s_apart():
    assert datasheet_name("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert datasheet_name("NVIDIA H100 PCIe") == "h100-pcie"
    assert datasheet_name("NVIDIA H100 NVL") == "h100-nvl"
    assert get_device("h100-pcie").gpu.sms == 114


def test_the_kernels_bench_dry_run_writes_a_table_the_cost_model_reads(tmp_path):
    bench = _bench("gpu_kernels")
    out = tmp_path / "dry.json"
    assert bench.main(["--dry-run", "--out", str(out)]) == 0
    table = KernelTable.from_json(json.loads(out.read_text()))
    assert len(table.gemm) == 3 * len(bench.gemm_shapes(64)) and table.attention and table.launch_s > 0
    # each forward product with its two backward ones, keyed as gemm_s asks for them: the weight's gradient
    # (K x M x N) sums over the tokens
    m, k, n = bench.gemm_shapes(64)[-1]
    assert {(r["pass"], r["m"], r["k"], r["n"]) for r in table.gemm} >= {
        ("forward", m, k, n), ("input-grad", m, n, k), ("weight-grad", k, m, n)}
    # the GPT cores again with attention dropout, priced from their own rows
    assert {(r["d"], r["dropout"]) for r in table.attention if r.get("dropout")} == {(64, 0.1), (128, 0.1)}
    assert table.attention_flops("math", "fp32", s=32, d=64, backward=True, dropout=True) > 0
    # the host's costs beyond an op's, and the sinks core's passes beside their aligned twins
    raw = json.loads(out.read_text())
    assert table.host_op_s > 0 and table.host_op_bwd_s > 0
    assert all(v["fwd_s"] > 0 and v["bwd_s"] > 0 for v in raw["host_calls"].values()) and len(raw["host_calls"]) == 2
    assert [r["op"] for r in raw["odd_rows"]] == ["broadcast_add", "add", "cat_column", "softmax_odd_rows",
                                                  "softmax_rows", "slice_gradient"]
    with pytest.raises(SystemExit, match="--out"):
        bench.main(["--dry-run"])


FIXTURE_COSTS = """device: NVIDIA H200, torch 2.11.0+cu130, parts: layers

case                       layer      fwd ms  bwd ms  analytic datasheet ms
-------------------------  ---------  ------  ------  ---------------------
gpt3-1.3b b4 s2048 bf16    block       1.724   3.823                  4.983
gpt3-1.3b b4 s2048 bf16    block       1.695   3.629                  4.983
"""
FIXTURE_SPEED = """run                                  samples/s  MFU    step ms  optimizer step ms  optimizer share
-----------------------------------  ---------  -----  -------  -----------------  ---------------
gpt3-1.3b-z1-mb4x4                       20.02  37.6%    799.4               78.1  9.8%
"""


def test_the_fidelity_bench_prices_each_record_as_it_ran(tmp_path, capsys):
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "layers.log").write_text(FIXTURE_COSTS)
    (tmp_path / "one" / "speed.log").write_text(FIXTURE_SPEED)
    bench = _bench("gpu_fidelity")
    records = bench.read_records(tmp_path)
    (rec,) = records.values()
    assert rec.key == ("gpt3-1.3b", "bf16", "block") and sorted(t for t, _ in rec.timings) == [5.324, 5.547]
    assert bench.read_steps(tmp_path)[0]["step_ms"] == 799.4
    assert bench.main(["--runs", str(tmp_path), "--json", str(tmp_path / "rows.json")]) == 0
    result = capsys.readouterr().out.strip().splitlines()[-1]
    assert result.startswith("RESULT block_head_median_err_pct=") and "fitted_records=0 predicted_records=2" in result
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert rows[0]["predicted_ms"] == pytest.approx(bench.predict_ms(rec)) and rows[1]["predicted_step_ms"] > 0


def test_a_plan_shows_where_its_step_goes():
    """plan's pick prints its step's shares (GEMMs, attention, memory-bound ops, host, communication inside
    the layers, optimizer, bubble, exposed communication): they add up to the step."""
    from ds_pipe_ext.plan.model import PlanModel
    from ds_pipe_ext.plan.shares import KINDS, render_shares, step_shares
    from ds_pipe_ext.plan.space import parse_only

    cfg = load_model("llama3-8b", layers=4)
    model = PlanModel.on_its_cluster(cfg, get_device("h100"), seq=4096, global_batch=8)
    cost = model.evaluate(parse_only("pp=2,tp=2,dp=2,mb=1,zero=1", gpus=8, global_batch=8))
    shares = step_shares(model, cost)
    assert list(shares) == list(KINDS) and all(v >= 0 for v in shares.values())
    assert sum(shares.values()) == pytest.approx(cost.step_s, rel=1e-9)
    assert shares["gemm"] > shares["attention"] > 0 and shares["communication in layers"] > 0
    assert shares["bubble, sends and waits"] > 0 and shares["exposed data-parallel communication"] > 0
    assert f"MFU {100 * cost.mfu:.1f}%" in render_shares(model, cost)


def test_the_fidelity_bench_reads_new_records_with_their_config_in_place_of_their_log(tmp_path):
    """bench/gpu_path.py's records carry the config they ran with; their part's log is then not parsed."""
    bench = _bench("gpu_fidelity")
    (tmp_path / "layers.log").write_text(FIXTURE_COSTS)
    (tmp_path / "gpu-path").mkdir()
    record = {"model": "gpt3-1.3b", "b": 4, "s": 2048, "dtype": "fp32", "layer": "block", "ms": 7.0,
              "timings_ms": [6.0, 7.0, 8.0], "tf32": True, "compiled": False, "overrides": {"tie_embeddings": False}}
    (tmp_path / "gpu-path" / "layers-records.json").write_text(json.dumps({"layers": [record]}))
    (rec,) = bench.read_records(tmp_path).values()
    assert rec.dtype == "fp32" and rec.tf32 and rec.spread == (6.0, 8.0) and rec.median_ms == 7.0
    # TF32 on: fp32 GEMMs priced on tensor cores, far faster than the CUDA cores of the old records
    assert bench.predict_ms(rec) < 0.5 * bench.predict_ms(replace(rec, tf32=False))
    # the pipe part's one-stage pipelines are priced as pipelines, under their own ZeRO stage
    step = {"run": "gpt3-1.3b-pp1-z0-mb4x4", "status": "ok", "model": "gpt3-1.3b", "overrides": {}, "micro_batch": 4,
            "micro_batches": 4, "compiled": False, "step_ms": 700.0, "pipeline": True, "zero": 0}
    (tmp_path / "gpu-path" / "pipe-records.json").write_text(json.dumps({"steps": [step]}))
    (pipe,) = bench.read_steps(tmp_path)
    assert pipe["pipeline"] and pipe["zero"] == 0
    data_parallel = {**pipe, "pipeline": False, "zero": 1}
    assert bench.predict_step_ms(pipe)[0] != pytest.approx(bench.predict_step_ms(data_parallel)[0], rel=1e-3)


def test_the_fidelity_bench_on_the_committed_gpu_records_fits_at_most_half(capsys):
    """The bench over docs/gpu-runs/ as committed (seconds, no GPU): its RESULT line, and no more records fit a
    figure than are predicted."""
    bench = _bench("gpu_fidelity")
    assert bench.main([]) == 0
    fields = dict(kv.split("=") for kv in capsys.readouterr().out.strip().splitlines()[-1].split()[1:])
    assert int(fields["fitted_records"]) <= int(fields["predicted_records"])
    assert set(fields) == {"block_head_median_err_pct", "block_head_max_err_pct", "embedding_max_err_pct",
                           "embedding_max_abs_err_ms",
                           "step_median_err_pct", "step_max_err_pct", "memory_peak_max_err_pct",
                           "saved_bytes_max_err_pct", "today_block_max_err_pct", "today_moe_layer_max_err_pct",
                           "fitted_records", "predicted_records"}
    # the memory rules each record showed (the attention output's copy, ZeRO-3's one-rank gather): within 3%
    assert float(fields["memory_peak_max_err_pct"]) <= 3.0 and float(fields["saved_bytes_max_err_pct"]) <= 3.0


def test_a_backward_adds_its_weight_gradients_into_the_last_ones_except_under_megatron():
    """AccumulateGrad's pass (both gradients read, one written) is in an eager or compiled backward, and
    not in Megatron's, whose GEMMs accumulate into main_grad themselves; Megatron-LM of 2021, before that
    fusion, ran the same pass beside its fused kernels."""
    h200 = get_device("h200")
    op = A.linear("x", 8, 4096, 4096, A.Shape(b=1, s=8, h=4096, a=1, f=4, V=4096), bias=False)
    passes = 3 * 4096 * 4096 * 2 / (h200.hbm_bandwidth * h200.gpu.bandwidth_fraction)
    assert G.grad_accumulate_s(op, dtype="bf16", spec=h200, execution="eager") == pytest.approx(passes)
    assert G.grad_accumulate_s(op, dtype="bf16", spec=h200, execution="megatron") == 0.0
    eager = h200.op_time(op, dtype="bf16", tp=1, backward=True)["time_s"]
    megatron = h200.op_time(op, dtype="bf16", tp=1, backward=True, execution="megatron")["time_s"]
    assert eager - megatron == pytest.approx(passes)
    unfused = h200.op_time(op, dtype="bf16", tp=1, backward=True, execution="megatron-2021")["time_s"]
    assert unfused - megatron == pytest.approx(passes)
    assert h200.op_time(op, dtype="bf16", tp=1, execution="megatron-2021") == h200.op_time(
        op, dtype="bf16", tp=1, execution="megatron")  # the forward is Megatron's either way


def test_an_embedding_backward_on_a_gpu_moves_its_table_in_its_own_dtype():
    """CUDA's embedding backward zeroes the table's gradient in the weights' dtype (no fp32 table: its
    partial sums are per token), then AccumulateGrad reads and writes it: fp32 moves twice bf16's bytes."""
    h200, cfg = get_device("h200"), load_model("gpt3-1.3b")
    times = {}
    for dtype in ("bf16", "fp32"):
        req = EstimateRequest(micro_batch=1, seq=128, dtype=dtype)
        word = next(iter(layer_ops(cfg, shape_for(cfg, req, h200))))[2][0]
        table = cfg.padded_vocab * cfg.hidden * (2 if dtype == "bf16" else 4)
        assert word.gpu_bytes[1] - word.fwd_bytes == pytest.approx(table + 8 * 128 * cfg.hidden)
        times[dtype] = op_rows([word], h200, req)[0]["bwd_s"]
    assert 1.8 < times["fp32"] / times["bf16"] < 2.0


def test_a_biased_linear_backward_on_a_gpu_holds_a_buffer_of_its_output_gradient():
    """CUDA's bias-gradient sum (AddmmBackward0 > aten::sum) holds a buffer of the output gradient's size;
    a CPU's holds none, and a linear without bias has no such sum."""
    cfg = load_model("gpt2-medium")
    req = EstimateRequest(micro_batch=8, seq=1024, dtype="bf16")
    gpu, cpu = shape_for(cfg, req, get_device("h200")), shape_for(cfg, req, get_device("h200"), runs_on="cpu")
    fc1 = A.linear("fc1", 8192, 1024, 4096, gpu)
    assert fc1.bwd_allocs == (8192 * 1024 * 2, (1024 * 4096 + 4096) * 2, 8192 * 4096 * 2)
    assert A.linear("fc1", 8192, 1024, 4096, cpu).bwd_allocs == fc1.bwd_allocs[:2]
    assert len(A.linear("fc1", 8192, 1024, 4096, gpu, bias=False).bwd_allocs) == 2


def test_the_gemm_rule_checks_against_xlas_whole_h100_grid(capsys):
    """bench/gemm_rule_vs_xla.py: XLA's measured H100 bf16 products (fitted nothing) hold the whole 256-4,096 grid,
    one row a shape, and the bench prices each by the rule: in the rule's one wave (8 x 8 tiles of 128 x 256 fill
    64 of 132 SMs) a GEMM costs the same at every output size below it, as the rule says."""
    bench = _bench("gemm_rule_vs_xla")
    shapes = bench.load_shapes()
    sides = (256, 512, 1024, 2048, 4096)
    assert sorted((r["m"], r["n"], r["k"]) for r in shapes) == [(m, n, k) for m in sides for n in sides for k in sides]
    assert all(1e12 < r["flops"] < 989e12 for r in shapes)  # under the H100's dense bf16 peak
    rows = {(r["m"], r["n"], r["k"]): r for r in bench.compare("h100-sxm")}
    assert rows[(1024, 2048, 4096)]["rule_us"] == pytest.approx(rows[(256, 256, 4096)]["rule_us"])
    assert rows[(1024, 2048, 4096)]["waves"] == pytest.approx(64 / 132)
    bench.main([])
    assert capsys.readouterr().out.splitlines()[-1].startswith("RESULT shapes=125 ")
    # a table of the other 124 shapes prices each left-out one closer through the rule's prior than alone
    loo = bench.leave_one_out("h100-sxm")
    assert len(loo) == 125
    assert (statistics.median(abs(r["err_pct"]) for r in loo)
            < statistics.median(abs(r["rates_alone_err_pct"]) for r in loo))


def test_the_collectives_check_reads_xlas_whole_h100_table(capsys):
    """bench/collectives_vs_xla.py: XLA's measured 8-GPU collectives (fitted nothing), each kind at every size from
    1 KiB to 2 GiB; the model's ring formula over the spec's NVLink gives a time that doubles with the size (no
    start-up cost), and NCCL's bus bandwidth reads back each row's time."""
    bench = _bench("collectives_vs_xla")
    rows = bench.load_rows()
    for kind in bench.KINDS:
        assert sorted(r["bytes"] for r in rows if r["kind"] == kind) == [2**k for k in range(10, 32)]
    out = {(r["kind"], r["bytes"]): r for r in bench.compare("h100-sxm")}
    big, small = out[("all-reduce", 2**31)], out[("all-reduce", 2**30)]
    assert big["model_s"] == pytest.approx(2 * small["model_s"])
    assert big["model_s"] == pytest.approx(2 * 7 / 8 * 2**31 / 450e9)
    assert bench.bus_bandwidth("all-reduce", 2**31, big["seconds"]) == pytest.approx(big["busbw"])
    bench.main([])
    assert capsys.readouterr().out.splitlines()[-1].startswith("RESULT rows=66 ")
