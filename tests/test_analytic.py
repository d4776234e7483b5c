"""The analytic model against published formulas and DeepSpeed's own estimators."""

import pytest

from ds_pipe_ext.costs import analytic as A

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
    matrix = lambda ops: sum(o.fwd_flops + o.bwd_flops for o in ops if o.kind == "matrix")  # noqa: E731
    got = L * matrix(A.transformer_block(shp)) + matrix(A.lm_head(shp))
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


@pytest.mark.parametrize("dp, stage", [(1, 2), (4, 2), (64, 2), (8, 3), (64, 3)])
def test_zero_model_states_match_deepspeed_estimators(dp, stage):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    params, largest = 1_300_000_000, 50257 * 2048
    ours = A.zero_model_state_bytes(params, dp, stage, largest_layer_params=largest)
    if stage == 2:
        _, theirs = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=dp, cpu_offload=False)
    else:
        _, theirs, _ = estimate_zero3_model_states_mem_needs(params, largest, num_gpus_per_node=dp, cpu_offload=False)
    assert ours == theirs


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
