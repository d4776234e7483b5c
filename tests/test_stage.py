"""The stage model: one owner of the in-flight rule, held bytes, per-stage sums and imbalance."""

import pytest

from ds_pipe_ext.costs.stage import held_activation_bytes, imbalance, in_flight, stage_costs
from ds_pipe_ext.costs.types import LayerCost
from ds_pipe_ext.partition import InfeasibleMemoryCap, partition_min_max
from ds_pipe_ext.partition.problem import make_problem


def costs():
    return [LayerCost(f"l{i}", forward_s=0.1 * (i + 1), backward_s=0.2 * (i + 1), recompute_s=0.05 * (i + 1),
                      param_bytes=100 * (i + 1), grad_bytes=100 * (i + 1), optimizer_bytes=200 * (i + 1),
                      activation_bytes=1000 * (i + 1), output_bytes=10 * (i + 1)) for i in range(5)]


def test_in_flight_follows_the_schedule():
    assert [in_flight(s, 4, 8) for s in range(4)] == [4, 3, 2, 1]  # 1F1B: min(p - s, m)
    assert [in_flight(s, 4, 2) for s in range(4)] == [2, 2, 2, 1]
    assert [in_flight(s, 4, 8, "gpipe") for s in range(4)] == [8, 8, 8, 8]
    # held until the deferred weight gradient: rank s defers s of them
    assert [in_flight(s, 4, 8, "zb-h1") for s in range(4)] == [4, 4, 4, 4]
    # two chunks per rank: the stages are the 2p chunks, each counted on its own
    assert [in_flight(s, 8, 8, "dualpipev") for s in range(8)] == [8, 7, 6, 5, 4, 3, 2, 1]
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'; known: gpipe, 1f1b, interleaved"):
        in_flight(0, 2, 2, "zb")
    with pytest.raises(ValueError, match="2 stages per rank: num_stages=3"):
        in_flight(0, 3, 8, "dualpipev")


def test_held_bytes_with_and_without_recompute():
    c = costs()
    assert held_activation_bytes(c) == [1000, 2000, 3000, 4000, 5000]
    assert held_activation_bytes(c, recompute=True) == [0, 10, 20, 30, 40]  # each layer keeps its input


def test_stage_costs_sum_layers_and_charge_boundaries():
    c = costs()
    a, b = stage_costs(c, [0, 2, 5], micro_batches=4, recompute=True, link_bandwidth=10.0)
    assert (a.start, a.stop, b.start, b.stop) == (0, 2, 2, 5)
    assert a.forward_s == pytest.approx(0.3) and b.forward_s == pytest.approx(1.2)
    assert a.backward_s == pytest.approx(0.6 + 0.15)  # backward + replayed forward
    assert (a.param_bytes, a.grad_bytes, a.optimizer_bytes) == (300, 300, 600)
    assert a.static_bytes == 1200 and b.static_bytes == 4 * (300 + 400 + 500)
    assert (a.boundary_in_bytes, a.boundary_out_bytes, b.boundary_in_bytes, b.boundary_out_bytes) == (0, 20, 20, 0)
    assert a.p2p_s == pytest.approx(2 * 20 / 10.0) and b.p2p_s == pytest.approx(2 * 20 / 10.0)
    assert (a.inflight, b.inflight) == (2, 1)
    assert a.activation_bytes == 0 + 10 and a.memory_bytes == 1200 + 2 * 10
    assert imbalance([a.time_s, b.time_s]) == pytest.approx(a.time_s / b.time_s)
    assert imbalance([3.0]) == 1.0 and imbalance([2.0, 4.0, 1.0]) == 0.25


def test_the_partitioner_reads_the_same_rule():
    c = costs()
    for schedule in ("1f1b", "gpipe"):
        prob = make_problem([x.time_s() for x in c], 3, static_bytes=[x.static_bytes for x in c],
                            activation_bytes=held_activation_bytes(c), micro_batches=6, schedule=schedule)
        assert [prob.inflight(s) for s in range(3)] == [in_flight(s, 3, 6, schedule) for s in range(3)]
        for s, st in enumerate(stage_costs(c, [0, 2, 4, 5], micro_batches=6, schedule=schedule)):
            assert prob.stage_memory(s, st.start, st.stop) == pytest.approx(st.memory_bytes)
    # GPipe holds every micro-batch: a cap that fits 1F1B's split does not fit GPipe
    cap = max(st.memory_bytes for st in stage_costs(c, [0, 3, 4, 5], micro_batches=6))
    parts = partition_min_max(c, 3, micro_batches=6, memory_cap_bytes=cap)
    assert max(st.memory_bytes for st in stage_costs(c, parts, micro_batches=6)) <= cap
    with pytest.raises(InfeasibleMemoryCap):
        partition_min_max(c, 3, micro_batches=6, memory_cap_bytes=cap, schedule="gpipe")
