import random

import pytest

from ds_pipe_ext.simulate.events import ChunkCosts, Link, Network, simulate
from ds_pipe_ext.simulate.stage_step import simulate_1f1b
from ds_pipe_ext.simulate.schedules import SCHEDULES, build_schedule, parse_schedule


def _deepspeed_order(sched, m):
    """(kind, micro-batch, phase) of every ForwardPass/BackwardPass a DeepSpeed schedule yields."""
    from deepspeed.runtime.pipe import schedule as ds

    out = []
    for cmds in sched.steps():
        for c in cmds:
            if isinstance(c, (ds.ForwardPass, ds.BackwardPass)):
                out.append(("F" if isinstance(c, ds.ForwardPass) else "B", c.buffer_id, getattr(c, "phase", 0)))
    return out


def test_1f1b_order_is_deepspeeds_train_schedule():
    """Micro-batch by micro-batch (TrainSchedule reuses buffers, so its own step -> micro-batch map)."""
    from deepspeed.runtime.pipe import schedule as ds

    for p in range(1, 9):
        for m in range(1, 17):
            ours = build_schedule("1f1b", p, m)
            for s in range(p):
                theirs = ds.TrainSchedule(micro_batches=m, stages=p, stage_id=s)
                kinds = [c for cmds in theirs.steps() for c in cmds if isinstance(c, (ds.ForwardPass, ds.BackwardPass))]
                ids = [theirs._step_to_micro_batch(k) for k in range(2 * (m + p - 1))]
                expected = [("F" if fwd else "B", i) for i, fwd in ids if 0 <= i < m]
                assert [("F" if isinstance(c, ds.ForwardPass) else "B") for c in kinds] == [k for k, _ in expected]
                assert [(w.kind, w.micro_batch) for w in ours.orders[s]] == expected, (p, m, s)


def test_dualpipev_order_is_deepspeeds_dualpipev_schedule():
    from deepspeed.runtime.pipe import schedule as ds

    for p in range(1, 9):
        for m in range(2 * p, 17):
            ours = build_schedule("dualpipev", p, m)
            for r in range(p):
                theirs = _deepspeed_order(ds.DualPipeVSchedule(micro_batches=m, stages=p, stage_id=r), m)
                chunk = (r, 2 * p - 1 - r)  # phase 0, phase 1
                expected = [(k, buf - ph * m, chunk[ph]) for k, buf, ph in theirs]
                assert [(w.kind, w.micro_batch, w.chunk) for w in ours.orders[r]] == expected, (p, m, r)
    with pytest.raises(ValueError, match="at least 2 x stages"):
        build_schedule("dualpipev", 4, 7)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_bubble_of_gpipe_and_1f1b_is_p_minus_1_over_m_plus_p_minus_1(name):
    for p, m in [(2, 1), (2, 4), (4, 4), (4, 8), (3, 7), (8, 16)]:
        sim = simulate(build_schedule(name, p, m), ChunkCosts([1.0] * p, [2.0] * p))
        assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1)), (p, m)
        assert sim.step_s == pytest.approx((m + p - 1) * 3.0)


def test_bubble_of_interleaved_is_p_minus_1_over_vm_plus_p_minus_1():
    for p, m, v in [(2, 4, 2), (4, 8, 2), (4, 4, 3), (3, 6, 4), (8, 16, 2)]:
        n = p * v
        sim = simulate(build_schedule("interleaved", p, m, virtual_stages=v),
                       ChunkCosts([1.0 / v] * n, [2.0 / v] * n))
        assert sim.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1)), (p, m, v)
    with pytest.raises(ValueError, match="multiple of the stages"):
        build_schedule("interleaved", 4, 6, virtual_stages=2)


def test_zb_h1_bubble_at_most_1f1b_with_equal_f_b_w():
    for p, m in [(2, 4), (4, 4), (4, 8), (3, 7), (8, 16), (6, 3)]:
        ones = [1.0] * p
        zb = simulate(build_schedule("zb-h1", p, m), ChunkCosts(ones, [2.0] * p, weight_grad_s=ones))
        base = simulate(build_schedule("1f1b", p, m), ChunkCosts(ones, [2.0] * p))
        assert zb.bubble_fraction <= base.bubble_fraction + 1e-12, (p, m)
        if p > 1 and m >= p:
            assert zb.step_s < base.step_s, (p, m)  # the W fill part of the tail


def _dependencies(w, n):
    """What ``w`` waits for: (kind, micro-batch, chunk) items that must have finished."""
    i, c = w.micro_batch, w.chunk
    if w.kind == "F":
        return [("F", i, c - 1)] if c > 0 else []
    if w.kind == "W":
        return [("I", i, c)]
    return [("F", i, c)] + ([(w.kind, i, c + 1), ] if c < n - 1 else [])


def test_every_schedule_respects_its_dependencies_randomised():
    rng = random.Random(0)
    for trial in range(60):
        name = rng.choice(SCHEDULES)
        p = rng.randint(1, 6)
        m = rng.randint(1, 12)
        v = rng.randint(2, 3) if name == "interleaved" else 1
        if name == "interleaved":
            m = p * rng.randint(1, 3)
        if name == "dualpipev":
            m = max(m, 2 * p)
        sched = build_schedule(name, p, m, virtual_stages=v)
        n = sched.num_chunks
        costs = ChunkCosts([rng.uniform(0.1, 2) for _ in range(n)], [rng.uniform(0.2, 4) for _ in range(n)],
                           output_bytes=[rng.uniform(0, 1e6) for _ in range(n)])
        net = Network(Link(rng.uniform(0, 0.5), rng.uniform(1e5, 1e7)))
        sim = simulate(sched, costs, network=net)
        kinds = {"W", "I"} if sched.splits_backward else {"B"}
        when = {(s.work.kind, s.work.micro_batch, s.work.chunk): s for s in sim.timeline}
        # every (kind, micro-batch, chunk) exactly once, on the chunk's rank
        assert len(when) == len(sim.timeline) == m * n * (1 + len(kinds)), (name, p, m)
        for s in sim.timeline:
            assert sched.chunk_rank[s.work.chunk] == s.rank
            for dep in _dependencies(s.work, n):
                dep = ("I", *dep[1:]) if dep[0] == "B" and "I" in kinds else dep
                before = when[dep]
                gap = 0.0
                if before.rank != s.rank:  # a transfer: at least the link latency
                    gap = net.intra.latency_s
                assert s.start_s >= before.end_s + gap - 1e-9, (name, p, m, s, before)
        for r in range(p):  # a rank runs one item at a time, in its order
            mine = [s for s in sim.timeline if s.rank == r]
            assert [s.work for s in mine] == list(sched.orders[r])
            assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(mine, mine[1:]))


def test_the_compute_only_replay_is_the_replay():
    """The planner's replay (no timeline) gives exactly the times of the replay that records one, on
    every schedule, with links shared inside and across nodes (transfers queue in the same order)."""
    rng = random.Random(1)
    for trial in range(60):
        name = rng.choice(SCHEDULES)
        p, m = rng.randint(1, 6), rng.randint(1, 12)
        v = rng.randint(2, 3) if name == "interleaved" else 1
        m = p * rng.randint(1, 3) if name == "interleaved" else max(m, 2 * p) if name == "dualpipev" else m
        assert_fast_replay_is_the_replay(build_schedule(name, p, m, virtual_stages=v), rng)


def assert_fast_replay_is_the_replay(sched, rng: random.Random) -> None:
    """Random costs, links inside and across nodes and updates: the replay without a timeline gives exactly
    the times of the one that records it (transfers queue on a link in the same order)."""
    n, p = sched.num_chunks, sched.num_ranks
    costs = ChunkCosts([rng.uniform(0.1, 2) for _ in range(n)], [rng.uniform(0.2, 4) for _ in range(n)],
                       weight_grad_s=[rng.uniform(0.05, 0.2) for _ in range(n)],
                       output_bytes=[rng.uniform(0, 1e6) for _ in range(n)])
    net = Network(Link(rng.uniform(0, 0.5), rng.uniform(1e5, 1e7)), Link(1.0, 1e5), ranks_per_node=2)
    opt = [rng.uniform(0, 1) for _ in range(p)]
    fast = simulate(sched, costs, network=net, optimizer_s=opt, timeline=False)
    slow = simulate(sched, costs, network=net, optimizer_s=opt)
    assert fast.stage_finish_s == slow.stage_finish_s and fast.step_s == slow.step_s, (sched.name, p)
    assert fast.stage_busy_s == slow.stage_busy_s and fast.held_peak == slow.held_peak
    assert max(s.end_s for s in slow.timeline) + max(opt) >= fast.step_s > 0


def test_the_explicit_replay_is_the_replay():
    """The planner's replay of DeepSpeed's engine order (its own sends and receives, no timeline) gives
    exactly the times of the replay that records one: rendezvous complete in the same order."""
    from ds_pipe_ext.pipe.schedules import engine_schedule

    rng = random.Random(2)
    for trial in range(40):
        name, p, m = rng.choice(["1f1b", "gpipe"]), rng.randint(2, 6), rng.randint(1, 12)
        sched = engine_schedule(name, p, m)
        assert sched.explicit_comm
        assert_fast_replay_is_the_replay(sched, rng)


def test_in_flight_forms_are_the_orders():
    """The closed forms the planner reads for one chunk a rank equal what the built orders hold."""
    for name in ("gpipe", "1f1b", "zb-h1"):
        for p in range(1, 9):
            for m in range(1, 20):
                assert parse_schedule(name).in_flight(p, m) == build_schedule(name, p, m).chunk_held_peak_counts, \
                    (name, p, m)


def test_activations_held_follow_the_schedule():
    p, m = 4, 8
    assert [build_schedule("gpipe", p, m).held_peak(r) for r in range(p)] == [m] * p
    one = [build_schedule("1f1b", p, m).held_peak(r) for r in range(p)]
    assert one == [min(p - r, m) for r in range(p)]
    # held until W: ZB-H1 keeps the r deferred weight gradients' micro-batches a while longer
    zb = [build_schedule("zb-h1", p, m).held_peak(r) for r in range(p)]
    assert all(z >= o for z, o in zip(zb, one)) and zb != one
    # two chunks a rank (counted in chunk-micro-batches): more than 1F1B's p - r
    dpv = build_schedule("dualpipev", p, m)
    assert all(dpv.held_peak(r) > one[r] for r in range(p))
    inter = build_schedule("interleaved", p, m, virtual_stages=2)
    assert all(inter.held_peak(r) / 2 > one[r] for r in range(p - 1))
    # bytes: weighted by each chunk's activations
    weights = [10.0, 20.0, 30.0, 40.0]
    assert build_schedule("1f1b", p, m).held_peak(0, weights) == 4 * 10.0


def test_each_chunks_held_peak_counted_alone_is_held_peak_with_that_chunk_weighted():
    for name, p, m, v in [("1f1b", 4, 6, 1), ("zb-h1", 3, 5, 1), ("interleaved", 3, 6, 3), ("dualpipev", 3, 7, 1),
                          ("gpipe", 2, 3, 1)]:
        sched = build_schedule(name, p, m, virtual_stages=v)
        n = sched.num_chunks
        alone = [sched.held_peak(sched.chunk_rank[c], [float(k == c) for k in range(n)]) for c in range(n)]
        assert list(sched.chunk_held_peak_counts) == alone, name


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


def test_links_differ_inside_and_across_nodes():
    """Two ranks per node: the 1 -> 2 boundary crosses nodes and pays the slow link."""
    costs = ChunkCosts([1.0] * 4, [2.0] * 4, output_bytes=[1e6] * 4)
    fast = simulate(build_schedule("1f1b", 4, 4), costs, network=Network(Link(0.0, 1e9)))
    slow = Network(Link(0.0, 1e9), inter=Link(0.5, 1e6), ranks_per_node=2)
    assert slow.link(1, 2).latency_s == 0.5 and slow.link(0, 1).latency_s == 0.0
    sim = simulate(build_schedule("1f1b", 4, 4), costs, network=slow)
    # the first forward and the last backward cross the slow link once each: 2 x (0.5 + 1 s)
    assert sim.step_s >= fast.step_s + 2 * 1.5 - 1e-9


def test_deepspeed_gpipe_schedule_runs_the_simulated_order():
    """ds_pipe_ext's GPipe PipeSchedule for DeepSpeed's engine: the order simulated, every micro-batch
    in its own buffer, each transfer where its compute needs it, the step at the end."""
    from deepspeed.runtime.pipe import schedule as ds

    from ds_pipe_ext.pipe.schedules import GPipeSchedule

    for p, m in [(1, 1), (2, 4), (3, 5), (4, 8)]:
        ours = build_schedule("gpipe", p, m)
        for s in range(p):
            sched = GPipeSchedule(micro_batches=m, stages=p, stage_id=s)
            cmds = [c for step in sched.steps() for c in step]
            compute = [("F" if isinstance(c, ds.ForwardPass) else "B", c.buffer_id) for c in cmds
                       if isinstance(c, (ds.ForwardPass, ds.BackwardPass))]
            assert compute == [(w.kind, w.micro_batch) for w in ours.orders[s]]
            assert sched.num_pipe_buffers() == max(2, m)
            sends = [c.buffer_id for c in cmds if isinstance(c, ds.SendActivation)]
            recvs = [c.buffer_id for c in cmds if isinstance(c, ds.RecvGrad)]
            assert sends == (list(range(m)) if s < p - 1 else []) and recvs == sends
            assert isinstance(cmds[-1], ds.OptimizerStep)


def test_link_emulator_delays_p2p_by_latency_plus_bytes_over_bandwidth(monkeypatch):
    import time

    import torch
    from deepspeed.runtime.pipe import p2p

    from ds_pipe_ext.compat import link_emulator

    calls = []
    monkeypatch.setattr(p2p, "send", lambda t, stage, async_op=False: calls.append(("send", stage)))
    monkeypatch.setattr(p2p, "recv", lambda t, stage, async_op=False: calls.append(("recv", stage)))
    original = p2p.send
    link_emulator.emulate_links(0.02, 1e6)  # 20 ms + 1 MB/s
    try:
        t0 = time.perf_counter()
        p2p.send(torch.zeros(10_000), 1)  # 40 kB: 40 ms more
        p2p.recv(torch.zeros(10_000), 0)
        took = time.perf_counter() - t0
    finally:
        link_emulator.restore()
    assert calls == [("send", 1), ("recv", 0)]
    assert took >= 2 * 0.06 - 1e-3
    assert p2p.send is original
    with pytest.raises(ValueError, match="bandwidth > 0"):
        link_emulator.emulate_links(0.0, 0.0)


def test_engine_schedules_place_transfers_as_deepspeed_does():
    """DeepSpeed's engine sends a 1F1B forward's output only after the next gradient receive, and both
    ends of a gloo/NCCL transfer wait for each other: the same compute order as the pure schedule, the
    same step on a free network, a longer one on a slow link."""
    from ds_pipe_ext.pipe.schedules import engine_schedule

    for name in ("1f1b", "gpipe"):
        for p, m in [(2, 4), (3, 6), (4, 2)]:
            run, pure = engine_schedule(name, p, m), build_schedule(name, p, m)
            for r in range(p):
                assert [w for w in run.orders[r] if w.kind in "FB"] == list(pure.orders[r])
            costs = ChunkCosts([1.0] * p, [2.0] * p, output_bytes=[1e6] * p)
            assert simulate(run, costs).step_s == pytest.approx(simulate(pure, costs).step_s)
            slow = Network(Link(0.5, 1e6))  # 1.5 s a transfer
            assert simulate(run, costs, network=slow).step_s > simulate(pure, costs, network=slow).step_s
    # 2 stages of 1F1B, 1 micro-batch-unit transfers both ways: F0 | SA0 ... (rendezvous), worked by hand
    run = engine_schedule("1f1b", 2, 1)
    assert [w.kind for w in run.orders[0]] == ["F", "SA", "RG", "B"]
    assert [w.kind for w in run.orders[1]] == ["RA", "F", "B", "SG"]
    sim = simulate(run, ChunkCosts([1.0, 1.0], [2.0, 2.0], output_bytes=[1.0, 1.0]),
                   network=Network(Link(0.25, 4.0)))  # 0.5 s a transfer
    assert sim.step_s == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)
