import pytest

from ds_pipe_ext.simulate.schedule import one_f_one_b_order, simulate_1f1b


def test_order_matches_deepspeed_train_schedule():
    """The per-stage order of ForwardPass/BackwardPass in DeepSpeed's TrainSchedule."""
    from deepspeed.runtime.pipe import schedule as ds

    for p, m in [(2, 4), (4, 4), (4, 2), (3, 7), (1, 3)]:
        for s in range(p):
            theirs = []
            for cmds in ds.TrainSchedule(micro_batches=m, stages=p, stage_id=s):
                for c in cmds:
                    if isinstance(c, ds.ForwardPass):
                        theirs.append("F")
                    elif isinstance(c, ds.BackwardPass):
                        theirs.append("B")
            assert [k for k, _ in one_f_one_b_order(s, p, m)] == theirs, (p, m, s)


def test_balanced_pipeline_makespan():
    # p equal stages of f + b: (m + p - 1) * (f + b)
    sim = simulate_1f1b([1.0] * 4, [2.0] * 4, 8)
    assert sim.step_s == pytest.approx((8 + 4 - 1) * 3.0)
    assert sim.bubble_fraction == pytest.approx(1 - 8 * 3 * 4 / (4 * 33))


def test_bottleneck_stage_and_extras():
    # two stages: t0 = 1 + 2, t1 = 2 + 4 (slow).  1F1B: fill through both, m - 1 more at the slow one.
    sim = simulate_1f1b([1.0, 2.0], [2.0, 4.0], 4)
    assert sim.step_s == pytest.approx(3.0 + 6.0 + 3 * 6.0)
    # p2p adds to the critical path on every crossing; the optimizer step after the last backward
    sim2 = simulate_1f1b([1.0, 2.0], [2.0, 4.0], 4, p2p_s=[0.5], optimizer_s=[1.0, 0.0])
    assert sim2.step_s == pytest.approx(27.0 + 2 * 0.5 + 1.0)
    with pytest.raises(ValueError, match="p2p_s needs 1"):
        simulate_1f1b([1.0, 2.0], [2.0, 4.0], 4, p2p_s=[])
