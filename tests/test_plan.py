"""The planner: its pruning loses nothing, its output is what users and tools read, bad input is named.

The exhaustive check simulates every layout of a small cluster without any pruning and demands
the search's top K be exactly that ranking: a bound that is not a bound fails it.
"""

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from ds_pipe_ext.cli import main
from ds_pipe_ext.models.gpt_config import load_model_config
from ds_pipe_ext.plan.bounds import layout_step_bound, split_step_bound
from ds_pipe_ext.cli.plan import build_model
from ds_pipe_ext.costs.cpu_comm import fit
from ds_pipe_ext.costs.hardware import adam_step_s
from ds_pipe_ext.costs.stage import held_activation_bytes
from ds_pipe_ext.costs.zero import state_bytes_per_param
from ds_pipe_ext.partition.algorithms import partition_min_max_lists, smallest_feasible_cap_lists
from ds_pipe_ext.plan.model import OutOfMemory
from ds_pipe_ext.plan.render import MegatronLayoutChecker, check_in_process, ds_config, megatron_layout
from ds_pipe_ext.plan.search import search
from ds_pipe_ext.layout import Layout
from ds_pipe_ext.plan.space import PlanError, enumerate_layouts, parse_only


def _layout(pp, tp, dp, zero, mb, m, recompute, sp, schedule) -> Layout:
    return Layout(pp=pp, tp=tp, dp=dp, zero=zero, micro_batch=mb, micro_batches=m, recompute=recompute, sp=sp,
                  schedule=schedule)

GIB = 2**30
JSON_KEYS = {"pp", "tp", "dp", "zero", "micro_batch", "recompute", "sp", "schedule", "parts", "step_s",
             "samples_per_s", "mfu", "peak_memory_bytes"}


def plan_model(model="gpt3-175b", gpus=1024, device="a100", global_batch=1536, **kw):
    args = SimpleNamespace(model=model, gpus=gpus, device=device, global_batch=global_batch, gpus_per_node=None,
                           intra_node_gbs=None, inter_node_gbs=None, seq=None, dtype=None)
    for k, v in kw.items():
        setattr(args, k, v)
    return build_model(args)


def test_plan_prints_both_runtimes_side_by_side(capfd):
    # DeepSpeed's engines by default; --runtime both adds Megatron-LM's, whose layouts shard at most the
    # optimizer states (its distributed optimizer)
    assert main(["plan", "--model", "gpt3-1.3b", "--gpus", "16", "--device", "a100", "--runtime", "both",
                 "--json", "--top", "3"]) == 0
    both = json.loads(capfd.readouterr().out)
    assert set(both) == {"deepspeed", "megatron"}
    assert {r["runtime"] for r in both["deepspeed"]} == {"deepspeed"}
    assert {r["runtime"] for r in both["megatron"]} == {"megatron"} and all(r["zero"] <= 1 for r in both["megatron"])
    assert main(["plan", "--model", "gpt3-1.3b", "--gpus", "16", "--device", "a100", "--json", "--top", "3"]) == 0
    assert json.loads(capfd.readouterr().out) == both["deepspeed"]
    # a ds.json is DeepSpeed's: refused under Megatron's runtime, before any planning
    assert main(["plan", "--model", "gpt3-1.3b", "--gpus", "16", "--device", "a100", "--runtime", "megatron",
                 "--emit-ds-config", "ds.json"]) != 0
    assert "--runtime deepspeed" in capfd.readouterr().err


def test_gpt3_175b_on_1024_a100_top10_fits_in_80gb_and_json_has_the_fields(capfd):
    assert main(["plan", "--model", "gpt3-175b", "--gpus", "1024", "--device", "a100", "--global-batch", "1536",
                 "--json"]) == 0
    rows = json.loads(capfd.readouterr().out)
    assert len(rows) >= 10
    steps = [r["step_s"] for r in rows[:10]]
    assert steps == sorted(steps)
    for r in rows:
        assert JSON_KEYS <= r.keys()
        assert r["pp"] * r["tp"] * r["dp"] == 1024
        assert r["micro_batch"] * r["micro_batches"] * r["dp"] == 1536
        assert r["peak_memory_bytes"] <= 0.9 * 80 * GIB  # mixed precision states + activations, 10% kept free
        assert len(r["parts"]) == r["pp"] * {"dualpipev": 2, "interleaved:2": 2, "interleaved:3": 3}.get(
            r["schedule"], 1) + 1
        assert 0.2 < r["mfu"] < 0.75  # a plausible A100 step, not a unit slip
        assert r["samples_per_s"] == pytest.approx(1536 / r["step_s"])
    # a layout DeepSpeed runs is always listed (the one --emit-ds-config writes)
    assert any(r["runnable"] for r in rows)


GLOO_LIKE = {"all-reduce": [2e-4, 2e9], "all-gather": [1.5e-4, 5e8], "reduce-scatter": [2.5e-4, 4e8],
             "p2p": [4e-5, 4e9]}


def with_device(model, **changes):
    """The same plan on a device with some fields changed (a fresh model: layer costs are cached)."""
    return model.on_device(replace(model.device, **changes))


@pytest.mark.parametrize("name, measured_links", [("compare-cpu", False), ("compare-cpu", True), ("moe-tiny", False)],
                         ids=["ring-formulas", "gloo-like-measured-links", "moe-expert-parallel"])
def test_the_search_loses_nothing_against_simulating_every_layout(name, measured_links):
    cfg, model = plan_model(name, gpus=8, device="a100", global_batch=64)
    if measured_links:  # latencies, slow collectives, p2p latency and Adam's page faults, as on CPU ranks
        model = with_device(model, collectives=GLOO_LIKE, fresh_page_bandwidth=1.5e9, fresh_alloc_min_bytes=2**20)
    layouts, _ = enumerate_layouts(cfg, 8, gpus_per_node=8, global_batch=64)
    everything = []
    for lay in layouts:
        try:
            cost = model.evaluate(lay)
        except OutOfMemory:
            continue
        # both bounds the search prunes with are bounds
        assert layout_step_bound(model, lay) <= cost.step_s * (1 + 1e-12), lay.name
        assert split_step_bound(model, lay, cost.parts) <= cost.step_s * (1 + 1e-12), lay.name
        everything.append(cost)
    everything.sort(key=lambda c: c.step_s)
    res = search(model, layouts, top_k=10)
    assert res.simulated < len(everything)  # it did prune
    got = [c.step_s for c in res.top[:10]]
    assert got == pytest.approx([c.step_s for c in everything[:10]], rel=1e-12)
    assert {c.layout for c in res.top[:10]} <= {c.layout for c in everything if c.step_s <= got[-1]}


def test_gloo_fit_recovers_latency_and_bus_bandwidth():
    lat, bw, n = 3e-4, 2e9, 2
    times = {"all-reduce": {s: lat + 2 * (n - 1) / n * s / bw for s in (2**16, 2**26)},
             "all-gather": {s: lat + (n - 1) / n * s / (bw / 4) for s in (2**16, 2**26)},
             "p2p": {s: lat / 10 + s / (2 * bw) for s in (2**16, 2**26)}}
    got = fit(times, n)
    assert got["all-reduce"] == pytest.approx([lat, bw])
    assert got["all-gather"] == pytest.approx([lat, bw / 4])
    assert got["p2p"] == pytest.approx([lat / 10, 2 * bw])


def test_measured_collectives_price_dp_zero_and_tp_communication():
    """Where the device has measured collectives they replace the ring formula on the link: a ZeRO-1
    update is DeepSpeed's bucketed all-reduce plus the all-gather of the weights; TP layers pay latency."""
    cfg, model = plan_model("tiny", gpus=2, device="a100", global_batch=4)
    gloo = with_device(model, collectives=GLOO_LIKE)
    lay = _layout(1, 1, 2, 1, 1, 2, "none", False, "none")
    params = 1e6
    # Adam over half the parameters and DeepSpeed's own passes over the gradients: no collective
    adam = adam_step_s(params / 2, gloo.device, bytes_per_param=gloo.adam_bytes_per_param) + gloo.engine_passes_s(lay, params)
    grads = params * gloo.e
    want = (2e-4 + grads / 2e9) + (1.5e-4 + 0.5 * grads / 5e8)  # all-reduce (2 (n-1)/n = 1) + all-gather
    assert gloo.update_s(lay, params) == pytest.approx(want + adam)
    assert gloo.update_s(lay, params) > model.update_s(lay, params)  # slower than NVLink's ring
    tp_fast = sum(c.forward_s for c in model.layer_costs(2, False, 1, "none"))
    tp_gloo = sum(c.forward_s for c in gloo.layer_costs(2, False, 1, "none"))
    assert tp_gloo > tp_fast + 2e-4 * cfg.layers  # at least one all-reduce's latency per block forward
    assert model.layer_costs(1, False, 1, "none") == gloo.layer_costs(1, False, 1, "none")  # no TP: no collective


def test_cpu_ranks_get_gloo_links_and_a_share_of_the_cores(monkeypatch):
    """``--device cpu``: the collectives and the shared-core factors measured between ranks (stubbed
    here: the real measurement spawns ranks) replace the memory copy as link and scale the peaks."""
    import ds_pipe_ext.costs.cpu_comm as cpu_comm
    from ds_pipe_ext.costs.hardware import get_device
    from ds_pipe_ext.cli.plan import as_cpu_ranks

    asked = []
    monkeypatch.setattr(cpu_comm, "measure_cpu_ranks", lambda ranks: asked.append(ranks) or
                        {"collectives": GLOO_LIKE, "shared": {"matrix": 0.9, "memory": 0.5}})
    cpu = get_device("cpu")
    ranks = as_cpu_ranks(cpu, 2)
    assert asked == [2] and ranks.collectives == GLOO_LIKE and ranks.name == "cpu"
    assert ranks.matrix_flops["fp32"] == pytest.approx(0.9 * cpu.matrix_flops["fp32"])
    assert ranks.hbm_bandwidth == pytest.approx(0.5 * cpu.hbm_bandwidth)
    _, model = plan_model("tiny", gpus=2, device="cpu", global_batch=4)  # through build_model, also stubbed
    assert model.device.collectives == GLOO_LIKE and model.adam_bytes_per_param == 80.0
    _, given = plan_model("tiny", gpus=2, device="cpu", global_batch=4, intra_node_gbs=5.0)
    assert given.device.collectives is None  # links given on the command line are the user's


def test_adam_pays_page_faults_for_large_fp32_tensors_only_on_a_cpu():
    cfg, model = plan_model("tiny", gpus=2, device="a100", global_batch=4)
    cpu_like = with_device(model, fresh_page_bandwidth=1e9, fresh_alloc_min_bytes=2**20)
    lay = _layout(1, 1, 2, 0, 1, 2, "none", False, "none")
    layers = [3e5, 1e5, 1e5, 3e5]  # two over 1 MiB in fp32, two under
    assert model.adam_fresh_bytes(lay, layers) == ()  # GPUs' caching allocator: none
    assert cpu_like.adam_fresh_bytes(lay, layers) == (1.2e6, 1.2e6)
    assert cpu_like.adam_fresh_bytes(replace(lay, zero=1), layers) == (4 * 8e5 / 2,)  # one flat partition a rank
    assert cpu_like.update_s(lay, 8e5, layers) == pytest.approx(cpu_like.update_s(lay, 8e5) + 2.4e6 / 1e9)


def test_one_measured_step_calibrates_the_speed_and_leaves_the_links():
    """``fit_speed`` finds the factor on compute and memory rates at which the predicted step equals the
    measured one: given a step predicted at a known speed it returns that speed; collectives keep the
    measured links, so the step is not simply divided by the factor."""
    from ds_pipe_ext.plan.speed import at_speed, fit_speed

    _, model = plan_model("tiny", gpus=2, device="a100", global_batch=4)
    gloo = with_device(model, collectives=GLOO_LIKE, fresh_page_bandwidth=1e9, fresh_alloc_min_bytes=2**20)
    lay = _layout(1, 1, 2, 1, 1, 2, "none", False, "none")
    slow = gloo.on_device(at_speed(gloo.device, 0.6))
    assert slow.device.hbm_bandwidth == pytest.approx(0.6 * gloo.device.hbm_bandwidth)
    assert slow.device.fresh_page_bandwidth == pytest.approx(0.6e9) and slow.device.collectives == GLOO_LIKE
    measured = slow.evaluate(lay).step_s
    factor, fitted = fit_speed(gloo, lay, [0, len(gloo.layer_costs(1, False, 1, "none"))], measured)
    assert factor == pytest.approx(0.6, rel=1e-6)
    assert fitted.evaluate(lay).step_s == pytest.approx(measured, rel=1e-6)
    assert measured < gloo.evaluate(lay).step_s / 0.6  # the links did not slow down
    with pytest.raises(PlanError, match="beyond 16x"):
        fit_speed(gloo, lay, None, 1e4)


def test_on_cpu_ranks_the_calibration_scales_gloos_links_with_the_cores():
    """Gloo over loopback is work of the same cores: on a 'cpu' device with measured collectives the
    fitted factor scales them too, so a layout whose ranks always compute together (DP) scales alike.
    The factor is their speed together: a pipeline's items while the other stage idles run at the
    spec's speed, so the pipeline's step grows by less."""
    from ds_pipe_ext.plan.speed import at_speed, fit_speed, links_are_cpu_work

    _, model = plan_model("tiny", gpus=2, device="a100", global_batch=4)
    cpu = with_device(model, name="cpu", collectives=GLOO_LIKE, fresh_page_bandwidth=1e9, fresh_alloc_min_bytes=2**20,
                      gpu=None)  # a CPU's roofline: no GPU kernels
    assert links_are_cpu_work(cpu.device) and not links_are_cpu_work(model.device)
    slow = at_speed(cpu.device, 0.5, links=True)
    assert slow.collectives["all-gather"] == pytest.approx([1.5e-4 / 0.5, 5e8 * 0.5])
    lays = [_layout(1, 1, 2, 1, 1, 2, "none", False, "none"), _layout(2, 1, 1, 0, 1, 4, "none", False, "1f1b")]
    parts = {lay.name: cpu.evaluate(lay).parts for lay in lays}
    measured = 1.25 * cpu.evaluate(lays[0], parts[lays[0].name]).step_s
    factor, fitted = fit_speed(cpu, lays[0], parts[lays[0].name], measured)
    assert factor == pytest.approx(0.8, rel=1e-6)
    assert fitted.step_model.alone_share == pytest.approx(0.8, rel=1e-6) and model.step_model.alone_share == 1.0
    dp, pipe = (cpu.evaluate(lay, parts[lay.name]).step_s for lay in lays)
    # DP: the step / 0.8, collectives and page faults included
    assert fitted.evaluate(lays[0], parts[lays[0].name]).step_s == pytest.approx(dp / 0.8, rel=1e-6)
    # (this tiny pipeline's step is mostly its update and p2p, which stay at the fitted speed)
    assert pipe < fitted.evaluate(lays[1], parts[lays[1].name]).step_s < 0.999 * pipe / 0.8
    gpu_factor, gpu_fitted = fit_speed(model, lays[0], parts[lays[0].name], 1.25 * model.evaluate(lays[0]).step_s)
    assert gpu_fitted.step_model.alone_share == 1.0  # a device a rank: no one else's compute slows it


def test_deepspeed_passes_over_the_gradients_are_counted_even_with_one_dp_rank():
    """What DeepSpeed 0.19 does to the gradients besides the collectives and Adam, in bytes of memory
    traffic (and first touches of new large buffers on a CPU): measured as 0.35 s of a bench-cpu
    pipeline stage's step on 2 CPU ranks with a DP group of one.  Worked by hand for 10^6 bf16
    gradients on a device moving 1 GB/s, whose CPU-like twin maps fresh pages at 1 GB/s."""
    _, model = plan_model("tiny", gpus=2, device="a100", global_batch=4)
    gpu_like = with_device(model, hbm_bandwidth=1e9, memory_efficiency=1.0)
    cpu_like = with_device(gpu_like, fresh_page_bandwidth=1e9, fresh_alloc_min_bytes=2**20)
    assert gpu_like.e == 2
    alone = _layout(1, 1, 1, 0, 1, 4, "none", False, "none")
    # ZeRO-0: flatten (r + w), copy back (r + w), the trainer's norm (r): 5 x 2 MB = 10 ms; the 2 MB
    # flat buffer is new every step: 2 ms more on the CPU
    assert gpu_like.engine_passes_s(alone, 1e6) == pytest.approx(0.010)
    assert cpu_like.engine_passes_s(alone, 1e6) == pytest.approx(0.012)
    # a bf16 pipeline without ZeRO runs BF16_Optimizer, accumulating in bf16 (0.19's default): each of the 4
    # micro-batches zeroes the gradients (2) and adds them into the buffers (2 + 2 + 2), 32 MB; the step reads
    # the buffers for the norm (2), casts them to fp32 (2 + 4), copies fp32 into bf16 (4 + 2) and zeroes the
    # buffers (2), 16 MB: 48 ms; the fp32 cast (4 MB) is new every step: 4 ms more on the CPU
    pipe = _layout(2, 1, 1, 0, 1, 4, "none", False, "1f1b")
    assert gpu_like.engine_passes_s(pipe, 1e6) == pytest.approx(0.048)
    assert cpu_like.engine_passes_s(pipe, 1e6) == pytest.approx(0.052)
    # accumulating in fp32: the add goes through a cast's temporary (2 + 4 + 4 + 4 + 4) and no cast at the step
    fp32_accum = with_device(model, hbm_bandwidth=1e9, memory_efficiency=1.0)
    fp32_accum.grad_accum_dtype = "fp32"  # ds.json's data_types.grad_accum_dtype (BLOOM's)
    assert fp32_accum.engine_passes_s(pipe, 1e6) == pytest.approx((4 * (2 + 18) + 4 + 6 + 4) * 1e-3)
    # BLOOM's 2022 optimizer set the 16-bit gradients to None before each backward: no zeroing, 4 x 2 MB less
    fp32_accum.lp_grads_to_none = True
    assert fp32_accum.engine_passes_s(pipe, 1e6) == pytest.approx((4 * 18 + 4 + 6 + 4) * 1e-3)
    dp2 = _layout(1, 1, 2, 0, 1, 2, "none", False, "none")  # and the scaling by 1/dp (r + w): 7 x 2 MB
    assert gpu_like.engine_passes_s(dp2, 1e6) == pytest.approx(0.014)
    # ZeRO-1 over 2 ranks, 5e5 gradients owned: the bf16 overflow check (amax, amin: 2 x 2 bytes each), the
    # float64 norm (2 + 16), flatten (2 + 4), copy into the 16-bit weights (4 + 2), the bucket copy of all
    # gradients (2 x 2 MB): 21 MB = 21 ms; the CPU maps the two float64 copies (1.2 MB, 2.8 MB: both over
    # 1 MiB) and the 2 MB flat partition: 6 ms
    z1 = replace(dp2, zero=1)
    cpu_like.check_grad_overflow = gpu_like.check_grad_overflow = True  # DeepSpeed's default for bf16
    assert cpu_like.engine_passes_s(z1, 1e6, [3e5, 7e5]) == pytest.approx(0.027)
    z2 = replace(dp2, zero=2, micro_batches=3)  # the bucket copy every micro-batch: 3 x 4 MB in place of 4 MB
    assert gpu_like.engine_passes_s(z2, 1e6) == pytest.approx(0.029)
    gpu_like.check_grad_overflow = False  # bf16.check_grad_overflow off (what plan emits): 2 MB less
    assert gpu_like.engine_passes_s(z2, 1e6) == pytest.approx(0.027)


def test_deepspeed_zero_loops_over_the_gradients_a_tensor_at_a_time_on_a_gpu():
    """ZeRO-1's step on a GPU: each owned tensor at the larger of its bytes and its nine kernels' host
    dispatch (the overflow check's seven, the norm's two), each tensor's bucket copy at the larger of its
    bytes and one dispatch.  Worked by hand on a device moving 1 GB/s with a 10 us dispatch."""
    _, model = plan_model("tiny", gpus=2, device="h100", global_batch=4)
    assert model.device.gpu is not None
    gpu = with_device(model, hbm_bandwidth=1e9, memory_efficiency=1.0,
                      gpu=replace(model.device.gpu, host_kernel_s=1e-5))
    gpu.check_grad_overflow = True  # DeepSpeed's default for bf16
    z1 = replace(_layout(1, 1, 2, 0, 1, 2, "none", False, "none"), zero=1)
    # 1,000 elements: 34 B owned each = 34 us < 90 us of dispatch; the copy 4 us < 10 us.  10^6: 34 ms, 4 ms.
    small, big = 1e3, 1e6
    expected = (90e-6 + 34e-3) / 2 + (10e-6 + 4e-3)
    assert gpu.engine_passes_s(z1, small + big, tensors=[small, big]) == pytest.approx(expected)
    # without the tensors (a profile cache that has none): the bytes alone
    assert gpu.engine_passes_s(z1, small + big) == pytest.approx((34 / 2 + 4) * (small + big) / 1e9)
    # without the overflow check: 30 bytes an owned element, the norm's two kernels (20 us < the small one's 30 us)
    gpu.check_grad_overflow = False
    expected = (30e-6 + 30e-3) / 2 + (10e-6 + 4e-3)
    assert gpu.engine_passes_s(z1, small + big, tensors=[small, big]) == pytest.approx(expected)


def test_memory_is_the_cap_of_the_exact_partition():
    """Recompute and more stages are what let a big model fit: without them nothing does; and the cap is the
    peak's (costs.peak): a split the at-step rule admits, the peak rule refuses."""
    cfg, model = plan_model("gpt3-175b", gpus=64, global_batch=64)
    fits = model.evaluate(_layout(8, 8, 1, 0, 1, 64, "full", True, "1f1b"))
    assert fits.peak_memory_bytes <= model.memory_cap and fits.parts[0] == 0 and fits.parts[-1] == 98
    with pytest.raises(OutOfMemory):  # one stage of 8 TP ranks: 22 G parameters a rank, 350 GB of states
        model.evaluate(_layout(1, 8, 8, 1, 1, 8, "full", True, "none"))
    with pytest.raises(OutOfMemory):  # nor any split into 2 stages without ZeRO: 11 G parameters x 20 B
        model.partition(_layout(2, 8, 4, 0, 1, 16, "full", True, "1f1b"))
    # ZeRO-1 over the 4 data-parallel ranks: at the step a stage holds 2 + 16 / 4 bytes a parameter, and the
    # at-step rule admits the even split (61.9 GiB against the 72 GiB cap); during the backward it holds
    # every 16-bit gradient until the boundary's reduction (2 + 2 + 12 / 4 bytes) and its bucket, and the
    # peak rule refuses every split (the least is 72.5 GiB)
    zero1 = _layout(2, 8, 4, 1, 1, 16, "full", True, "1f1b")
    costs = model.layer_costs(8, True, 1, "full")
    at_step = dict(static_bytes=[c.param_bytes / 2 * state_bytes_per_param(1, 4, 2) for c in costs],
                   activation_bytes=held_activation_bytes(costs, recompute=True), micro_batches=16)
    times = [c.time_s(recompute=True) for c in costs]
    assert partition_min_max_lists(times, 2, memory_cap=model.memory_cap, **at_step) == [0, 49, 98]
    with pytest.raises(OutOfMemory):
        model.partition(zero1)
    assert model.least_memory(zero1) > model.memory_cap > smallest_feasible_cap_lists(times, 2, **at_step)


def test_megatron_layout_strings_are_checked_by_megatron_core():
    cfg = load_model_config("gpt3-175b")
    lay = _layout(8, 8, 16, 1, 1, 96, "none", True, "1f1b")
    cost = SimpleNamespace(layout=lay, parts=[0, 13, 25, 37, 49, 61, 73, 85, 98])
    text, why = megatron_layout(cost, cfg.layers)
    assert text == "Et*12|(t*12|)*6t*12L" and "megatron-core" in why
    uneven = SimpleNamespace(layout=_layout(2, 1, 1, 0, 1, 4, "none", False, "1f1b"), parts=[0, 3, 6])
    assert megatron_layout(uneven, 4)[0] == "Et*2|t*2L"
    # interleaved: chunks in virtual order, chunk c on rank c % p, as Megatron reads the list
    inter = SimpleNamespace(layout=_layout(2, 1, 1, 0, 1, 4, "none", False, "interleaved:2"), parts=[0, 2, 3, 5, 6])
    assert megatron_layout(inter, 4)[0] == "Et|t|t*2|L"
    v = SimpleNamespace(layout=_layout(2, 1, 1, 0, 1, 4, "none", False, "dualpipev"), parts=[0, 2, 3, 5, 6])
    text, why = megatron_layout(v, 4)
    assert text is None and "V" in why
    # the plan command asks a child interpreter (its megatron import overlaps the search): same verdicts
    checker = MegatronLayoutChecker()
    try:
        assert megatron_layout(cost, cfg.layers, checker) == megatron_layout(cost, cfg.layers)
        assert checker("Et*2|t*2L", 2, 4) == check_in_process("Et*2|t*2L", 2, 4) == {}
        bad = checker("Et*3|t*2L", 2, 4)  # 5 blocks for a 4-block model
        assert "error" in bad and bad == check_in_process("Et*3|t*2L", 2, 4)
    finally:
        checker.close()


def test_emitted_ds_config_is_a_pipeline_config_train_py_reads(tmp_path):
    from ds_pipe_ext.train.config import build_run_config

    cost = SimpleNamespace(layout=_layout(2, 1, 1, 0, 2, 4, "full", False, "1f1b"), parts=[0, 4, 6])
    ds = ds_config(cost, model="tiny", dtype="fp32")
    assert ds["pipeline"] == {"stages": 2, "partition_method": "parts:0,4,6", "schedule": "1f1b"}
    run = build_run_config(json.loads(json.dumps(ds)))
    assert run.pipelined and run.pipeline.partition_method == "parts:0,4,6" and run.train.recompute == "full"
    assert (run.micro_batch, run.grad_accum) == (2, 4)
    with pytest.raises(ValueError, match="simulated|runs no"):
        ds_config(SimpleNamespace(layout=_layout(2, 1, 1, 0, 2, 4, "none", False, "zb-h1"), parts=[0, 4, 6]),
                  model="tiny")


def test_only_evaluates_one_layout_and_names_bad_keys():
    lay = parse_only("pp=8,tp=8,dp=16,mb=1,recompute=full,sp=on,zero=1,schedule=interleaved:3", gpus=1024,
                     global_batch=1536)
    assert (lay.pp, lay.tp, lay.dp, lay.micro_batches, lay.chunks_per_rank, lay.runnable) == (8, 8, 16, 96, 3, False)
    with pytest.raises(PlanError, match="pp x tp x dp = 512"):
        parse_only("pp=8,tp=8,dp=8", gpus=1024, global_batch=1536)
    with pytest.raises(PlanError, match="KEY=VALUE"):
        parse_only("stages=8", gpus=8, global_batch=8)
    with pytest.raises(PlanError, match="ZeRO-0 or 1 under a pipeline"):
        parse_only("pp=2,dp=4,zero=3", gpus=8, global_batch=8)
    assert parse_only("pp=2,dp=4,ep=2", gpus=8, global_batch=8).ep == 2
    with pytest.raises(PlanError, match="ep = 3 does not divide tp x dp = 4"):
        parse_only("pp=2,dp=4,ep=3", gpus=8, global_batch=8)


@pytest.mark.parametrize("argv, match", [
    (["--model", "gpt3-175b", "--gpus", "101", "--global-batch", "1536"], "no layout of 101 GPUs"),
    (["--model", "gpt3-175b", "--gpus", "8", "--global-batch", "8"], r"fits in no layout.*smallest need is \d"),
    (["--model", "tiny", "--gpus", "2", "--device", "tpu-v9"], "--device"),
    (["--model", "tiny", "--gpus", "2", "--global-batch", "0"], "--global-batch 0"),
    (["--model", "tiny", "--gpus", "4", "--global-batch", "3", "--only", "dp=4"], "not a multiple of mb x dp"),
    (["--model", "tiny", "--gpus", "0"], "--gpus 0"),
    (["--model", "bench-cpu", "--gpus", "2", "--only", "tp=2"], "vocab_pad_to = 256"),
    (["--model", "tiny", "--gpus", "8", "--profile-layers"], "--profile-layers .* --device cpu"),
])
def test_bad_input_names_the_problem(argv, match, capfd):
    import re

    assert main(["plan", *argv]) == 2
    err = capfd.readouterr().err
    assert re.search(match, err), err


def test_tp_must_divide_the_vocabulary_as_train_py_demands():
    """bench-cpu's 50257 rows split over no TP degree: those layouts are dropped with the fix named."""
    cfg = load_model_config("bench-cpu")
    layouts, dropped = enumerate_layouts(cfg, 8, gpus_per_node=8, global_batch=8)
    assert layouts and all(lay.tp == 1 for lay in layouts)
    assert any("vocab_pad_to" in reason for reason in dropped)
    padded, _ = enumerate_layouts(load_model_config("bench-cpu", vocab_pad_to=1024), 8, gpus_per_node=8,
                                  global_batch=8)
    assert {lay.tp for lay in padded} == {1, 2, 4, 8}


def test_smallest_need_is_the_least_over_layouts():
    """The OOM figure is a real minimum: no layout fits in less, the one that needs it fits in it."""
    cfg, model = plan_model("gpt3-175b", gpus=8, global_batch=8)
    layouts, _ = enumerate_layouts(cfg, 8, gpus_per_node=8, global_batch=8)
    with pytest.raises(PlanError) as err:
        search(model, layouts)
    need = float(err.value.args[0].split("smallest need is ")[1].split(" GiB")[0]) * GIB
    least = min(model.least_memory(lay) for lay in layouts)
    assert need == pytest.approx(least, rel=0.01)


@pytest.mark.multiprocess
@pytest.mark.usefixtures("forked_ranks")
def test_emitted_ds_config_trains_with_train_py_on_2_ranks(tmp_path, capfd):
    """A plan for llama-tiny (the Llama family: 7 pipeline layers, grouped-query attention) emitted as a ds.json
    trains under train.py on 2 ranks with the plan's split, micro-batching and recompute.  Under a cap (3.4 MB
    a rank) where recomputing every layer is slower than recomputing some, the plan emits a mode per layer
    with its split (issue 36), and the run builds exactly those."""
    from ds_pipe_ext.runner import launch

    ds = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama-tiny", "--gpus", "2", "--device", "cpu", "--global-batch", "8",
                 "--only", "pp=2,mb=2,recompute=full", "--memory-fraction", "0.0003", "--emit-ds-config", str(ds)]) == 0
    out = capfd.readouterr().out
    emitted = json.loads(ds.read_text())
    parts = [int(b) for b in emitted["pipeline"]["partition_method"].removeprefix("parts:").split(",")]
    modes = emitted["train"]["recompute"]
    assert "with per-stage recompute: parts " + str(parts) in out and "(emitted)" in out
    assert isinstance(modes, list) and len(modes) == 7 and {"full", "none"} <= set(modes)
    assert "activation_checkpoint_interval" not in emitted["pipeline"]
    proc, ranks = launch(2, ds, "--steps", "2", out_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(ranks) == [0, 1] and all(r["parts"] == parts for r in ranks.values())
    assert (ranks[0]["micro_batch"], ranks[0]["grad_accum"], ranks[0]["recompute"]) == (2, 4, modes)
    built = {int(i): m for r in ranks.values() for i, m in r["recomputed_layers"].items()}
    assert built == {i: m for i, m in enumerate(modes) if m != "none"}
    assert ranks[0]["model"] == "llama-tiny" and parts[-1] == 7


def test_only_evaluates_a_layout_over_the_cap_and_marks_it(capfd):
    """The layout the user names is evaluated, not refused: its step and peak are printed with the mark."""
    import re

    assert main(["plan", "--model", "gpt3-175b", "--gpus", "8", "--global-batch", "8", "--only", "pp=8"]) == 0
    out = capfd.readouterr().out
    row = next(line for line in out.splitlines() if "pp8-tp1-dp1-z0-mb1-none-1f1b" in line and "(over)" in line)
    peak, step = re.search(r"([\d.]+) \(over\)\s+([\d.]+)", row).groups()
    over = float(re.search(r"over the cap by ([\d.]+) GiB", out).group(1))
    assert float(step) > 0 and float(peak) - over == pytest.approx(0.9 * 80, abs=0.06)  # A100-80GB at 0.9
    # --memory-fraction sets the cap: at 1.0 the same peak is 8 GiB less over it
    assert main(["plan", "--model", "gpt3-175b", "--gpus", "8", "--global-batch", "8", "--only", "pp=8",
                 "--memory-fraction", "1.0"]) == 0
    over_all = float(re.search(r"over the cap by ([\d.]+) GiB", capfd.readouterr().out).group(1))
    assert over - over_all == pytest.approx(8.0, abs=0.02)
    assert main(["plan", "--model", "tiny", "--gpus", "2", "--memory-fraction", "1.5"]) == 2


def test_the_best_runnable_layout_is_found_past_the_first_one(monkeypatch):
    """The layout `plan` emits (the best one DeepSpeed runs) is the best runnable one, not the first one
    evaluated: a runnable layout whose bound is above the top K still counts while it can beat the
    runnable layout found so far.  Fake costs: bounds 1 < 2 < 3, steps 1 (simulated only), 10, 4."""
    import ds_pipe_ext.plan.search as plan_search

    lays = {name: SimpleNamespace(name=name, runnable=runnable, bound=bound, step=step)
            for name, runnable, bound, step in [("sim", False, 1.0, 1.0), ("slow", True, 2.0, 10.0),
                                                ("fast", True, 3.0, 4.0)]}
    monkeypatch.setattr(plan_search, "memory_lower_bound", lambda model, lay: 0.0)
    monkeypatch.setattr(plan_search, "layout_step_bound", lambda model, lay: lay.bound)
    monkeypatch.setattr(plan_search, "split_step_bound", lambda model, lay, parts: lay.bound)
    model = SimpleNamespace(memory_cap=1.0, partition=lambda lay: [0, 1], run_split=lambda lay: [0, 1],
                            evaluate=lambda lay, parts, check_memory=True: SimpleNamespace(layout=lay,
                                                                                          step_s=lay.step))
    res = search(model, list(lays.values()), top_k=1)
    assert [c.layout.name for c in res.top] == ["sim", "fast"]
    assert res.best_runnable().layout.name == "fast" and res.simulated == 3


def test_a_mixture_of_experts_plan_shows_and_emits_expert_parallelism(tmp_path, capfd):
    """Mixtral 8x7B on 64 H100: EP is a dimension (the table's ep column, the layout names), ZeRO-3 is dropped
    with DeepSpeed's reason, and the emitted ds.json carries the pick's EP degree."""
    out = tmp_path / "ds.json"
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "64", "--device", "h100", "--top", "5",
                 "--emit-ds-config", str(out)]) == 0
    text = capfd.readouterr().out
    head = next(line for line in text.splitlines() if line.lstrip().startswith("#  layout"))
    assert head.split()[3:7] == ["tp", "dp", "ep", "zero"]
    assert "native DeepSpeed MoE is not supported with ZeRO Stage 3" in text
    ds = json.loads(out.read_text())
    pick = Layout.from_ds_config(ds, 64)
    assert pick.ep > 1 and ds["moe"] == {"ep_size": pick.ep} and "-ep" in text


def test_per_stage_recompute_beats_every_global_setting_on_gpt3_175b(capfd):
    """GPT-3 175B on 1,024 A100-40GB, pp 8 x tp 8 x dp 16, 1F1B: the split and each layer's recompute chosen
    together (after the search) predict a shorter step than none (its capped split), selective and full
    recompute on every layer, and say which layers each stage recomputes."""
    import re

    steps = {}
    for mode in ("none", "selective", "full"):
        assert main(["plan", "--model", "gpt3-175b", "--gpus", "1024", "--device", "a100-40gb", "--only",
                     f"pp=8,tp=8,dp=16,mb=1,recompute={mode},sp=on,schedule=1f1b,zero=1"]) == 0
        out = capfd.readouterr().out
        line = next(line for line in out.splitlines() if line.startswith("  with per-stage recompute"))
        ours, theirs = map(float, re.search(r"step ([\d.]+) s against ([\d.]+) s", line).groups())
        steps[mode] = theirs
        assert ours < theirs and "stage 0: selective" in line
    assert steps["selective"] < steps["none"] < steps["full"]


def test_a_gpu_plan_prices_and_emits_zero_buckets_sized_to_the_model(tmp_path, capfd):
    """On a GPU the plan's ZeRO buckets are transformers' "auto" sizes for the model (h^2, 0.9 h^2, 10 h),
    priced and written alike; CPU-sized buckets (5e6 elements) would make ZeRO-3 on 384 A100 latency-bound."""
    from ds_pipe_ext.layout import ZERO_SETTINGS, zero_settings_for

    h = 12288  # gpt3-175b
    out = tmp_path / "ds.json"
    only = "pp=1,tp=1,dp=384,mb=4,recompute=full,zero=3"
    assert main(["plan", "--model", "gpt3-175b", "--gpus", "384", "--device", "a100", "--global-batch", "1536",
                 "--only", only, "--emit-ds-config", str(out)]) == 0
    capfd.readouterr()
    zero = json.loads(out.read_text())["zero_optimization"]
    assert (zero["stage"], zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (3, h * h, int(0.9 * h * h), 10 * h)
    # DeepSpeed prefetches nothing while more than stage3_max_live_parameters are gathered: the largest module
    # (the embedding, 51,200 x h, above an MLP matrix's 4 h^2 + 4 h) and the next must fit, as the plan prices
    assert zero["stage3_max_live_parameters"] == 2 * 51200 * h > 2 * (4 * h * h + 4 * h) > 1e9
    assert zero_settings_for(512, "cpu") == ZERO_SETTINGS
    _, model = plan_model(gpus=384)
    lay = parse_only(only, gpus=384, global_batch=1536)
    priced = model.evaluate_named(lay).step_s
    small = type(model)(model.cfg, model.device, model.cluster, seq=model.seq, global_batch=1536,
                        dtype=model.dtype, zero_settings=ZERO_SETTINGS).evaluate_named(lay).step_s
    assert small > 1.3 * priced  # each bucket's NCCL latency, hundreds of ring steps at 384 ranks


@pytest.mark.parametrize("model, gpus, mtp", [("deepseek-v3", 256, True), ("gpt-oss-20b", 16, False),
                                               ("gpt-oss-120b", 32, False)])
def test_todays_moe_models_plan_with_expert_parallelism_and_a_megatron_layout(model, gpus, mtp, capfd):
    """The published shapes (model_configs/) plan on H100 clusters: the pick splits the experts (ep > 1) and
    comes with the Megatron layout string megatron-core accepts, DeepSeek-V3's MTP layer as its own ``m``."""
    import re

    assert main(["plan", "--model", model, "--gpus", str(gpus), "--device", "h100", "--top", "3"]) == 0
    text = capfd.readouterr().out
    pick = next(line for line in text.splitlines() if line.startswith("pick: "))
    assert int(re.search(r"-ep(\d+)-", pick).group(1)) > 1
    layouts = [line for line in text.splitlines() if "Megatron pipeline_model_parallel_layout" in line]
    assert "checked with megatron-core" in layouts[0] or "no pipeline" in layouts[0]
    if mtp:
        assert re.search(r"m\|?L'", layouts[0]) and "checked with megatron-core" in layouts[0]
