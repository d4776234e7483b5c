"""Megatron tensor/sequence parallelism against one process with no parallelism.

Two real processes (gloo) run the GPT with TP=2, SP on and off, from the weights of
a single-process model sliced per rank.  The first loss and gradient norm must
agree to 1e-5 (relative) and the losses after 3 AdamW steps to 1e-4.
"""

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from ds_pipe_ext.models.gpt_config import load_model_config

STEPS, LR = 3, 1e-3


def batch(cfg):
    t = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(7))
    return t[:, :-1], t[:, 1:]


def train_steps(model, x, y, grad_norm_fn):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    losses, norm, head_norm_grads = [], None, {}
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        if step == 0:
            norm = grad_norm_fn(model)
            # replicated over TP and small: a rank's unsummed share would pass the norm's tolerance
            head_norm_grads = {n: p.grad.tolist() for n, p in model.named_parameters() if "_norm.weight" in n
                               and n.split(".")[-2] in ("q_norm", "k_norm")}
        losses.append(loss.item())
        opt.step()
    return losses, norm, head_norm_grads


def tiny(tied: bool, name: str = "tiny"):
    """``tiny`` (GPT) or ``llama-tiny`` (GQA with 2 key/value heads: one per rank at TP 2; 5 blocks), tied or not."""
    from dataclasses import replace

    from ds_pipe_ext.models import load_model

    return replace(load_model(name), tie_embeddings=tied)


MODELS = ("tiny", "llama-tiny")  # each launch runs both, in turn
# in-process TP also runs Qwen3's attention: heads wider than hidden / heads, q/k norms whose gradients each
# rank computes from its own heads
TP_MODELS = MODELS + ("qwen3-tiny",)


def _worker(rank, world, sp, init_file, refs, out_path, tied=False):
    import torch.distributed as dist

    from ds_pipe_ext.layout import Layout
    from ds_pipe_ext.models import family_of
    from ds_pipe_ext.models.tensor_parallel import shard_like
    from ds_pipe_ext.parallel.topology import initialize

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    initialize(Layout(pp=1, tp=world, dp=1, sp=sp), world)

    def grad_norm(m):
        split = torch.zeros(())
        replicated = torch.zeros(())
        for p in m.parameters():
            g2 = p.grad.double().pow(2).sum()
            if getattr(p, "tensor_model_parallel", False):
                split += g2
            else:
                replicated += g2  # identical on every TP rank: count once
        dist.all_reduce(split)
        return float((split + replicated).sqrt())

    got = {}
    for name in TP_MODELS:
        cfg = tiny(tied, name)
        family = family_of(cfg)
        impl = family.tensor_parallel(world, sp)
        model = family.sequential(family.layer_specs(cfg, impl), family.loss_fn(cfg, impl), base_seed=None, recompute=False)
        model.load_state_dict(shard_like(torch.load(refs[name]), model))
        losses, norm, head_norm_grads = train_steps(model, *batch(cfg), grad_norm)
        got[name] = {"losses": losses, "grad_norm": norm, "head_norm_grads": head_norm_grads}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(got, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.parametrize("sp, tied", [(False, False), (True, False), (True, True)], ids=["tp2", "tp2_sp", "tp2_sp_tied"])
def test_tp_parity_with_single_process(tmp_path, sp, tied):
    """The GPT, llama-tiny (grouped-query attention split by key/value heads, [gate_r; up_r]) and qwen3-tiny
    (per-head q/k norms, summed over TP) in each launch."""
    from ds_pipe_ext.models import family_of

    def norm(m):
        return float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in m.parameters())))

    want, refs = {}, {}
    for name in TP_MODELS:
        cfg = tiny(tied, name)
        family = family_of(cfg)
        reference = family.sequential(family.layer_specs(cfg), family.loss_fn(cfg), base_seed=1234, recompute=False)
        refs[name] = str(tmp_path / f"{name}.pt")
        torch.save(reference.state_dict(), refs[name])
        want[name] = train_steps(reference, *batch(cfg), norm)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # forked, not spawned: the ranks start without importing torch again (this process holds no process group)
    mp.start_processes(_worker, args=(2, sp, str(tmp_path / "init"), refs, str(tmp_path / "out.json"), tied),
                       nprocs=2, join=True, start_method="fork")
    got = json.loads((tmp_path / "out.json").read_text())
    for name in TP_MODELS:
        want_losses, want_norm, want_head_norm_grads = want[name]
        assert got[name]["losses"][0] == pytest.approx(want_losses[0], rel=1e-5), name
        assert got[name]["grad_norm"] == pytest.approx(want_norm, rel=1e-5), name
        assert got[name]["losses"] == pytest.approx(want_losses, rel=1e-4), name
        assert got[name]["head_norm_grads"].keys() == want_head_norm_grads.keys()
        for param, grad in want_head_norm_grads.items():
            torch.testing.assert_close(torch.tensor(got[name]["head_norm_grads"][param]), torch.tensor(grad),
                                       rtol=1e-4, atol=1e-8, msg=f"{name}: {param}")
    assert len(want["qwen3-tiny"][2]) == 6  # q and k norms of 3 blocks


def auto_recompute_cap() -> float:
    """A cap (GiB) between the smallest any split of llama-tiny fits with recompute chosen per layer and the
    smallest without, by the costs the PP 2 x TP 2 launch's analytic partition computes (micro-batch 4, 4
    micro-batches, fp32, ZeRO-0)."""
    from ds_pipe_ext.costs.hardware import get_device
    from ds_pipe_ext.costs.peak import ZeroSettings
    from ds_pipe_ext.costs.peak_rule import PipelinePeakRule
    from ds_pipe_ext.costs.zero import layer_states_by_rule
    from ds_pipe_ext.models import family_of
    from ds_pipe_ext.models.layers import LOCAL
    from ds_pipe_ext.partition import InfeasibleMemoryCap, partition_jointly, partition_min_max
    from ds_pipe_ext.train.data import SyntheticTokens

    cfg = tiny(False, "llama-tiny")
    tokens = next(SyntheticTokens(cfg.vocab_size, 4, cfg.seq_len, seed=0))[0]
    costs = family_of(cfg).cost_model(cfg, LOCAL).layer_costs(tokens, tp=2, device=get_device("cpu"), dtype="fp32")
    costs = layer_states_by_rule(costs, stage=0, dp=1, element_bytes=4)
    rule = PipelinePeakRule(ZeroSettings.from_ds_config({"zero_optimization": {"stage": 0}}), 1, 4)
    least = []
    for split in (partition_jointly, partition_min_max):
        with pytest.raises(InfeasibleMemoryCap) as err:
            split(costs, 2, memory_cap_gib=1e-6, micro_batches=4, peak_rule=rule)
        least.append(err.value.min_feasible_cap / 2**30)
    assert least[0] < least[1]
    return sum(least) / 2


def serial_reference(cfg, weights_path, steps, *, micro_batch=4, gas=4, seed=1234, lr=3e-4, clip=1.0):
    """What train.py computes in one process: same data stream as DP rank 0, mean of the micro-batch losses; the
    gradient clipped to norm ``clip`` (DeepSpeed's default gradient_clipping), its norm before the clip recorded."""
    from ds_pipe_ext.models import family_of
    from ds_pipe_ext.train.data import SyntheticTokens

    family = family_of(cfg)
    model = family.sequential(family.layer_specs(cfg), family.loss_fn(cfg), base_seed=None, recompute=False)
    model.load_state_dict(torch.load(weights_path))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    data = SyntheticTokens(cfg.vocab_size, micro_batch, cfg.seq_len, seed=seed + 1000)
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad()
        micro = []
        for _ in range(gas):
            x, y = next(data)
            loss = model(x, y)
            (loss / gas).backward()
            micro.append(loss.item())
        norms.append(float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters()))))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        losses.append(sum(micro) / gas)
        opt.step()
    return losses, norms


@pytest.mark.multiprocess
@pytest.mark.usefixtures("forked_ranks")
def test_pp2_tp2_parity_through_deepspeed(tmp_path):
    """deepspeed --num_gpus 4: PP=2 x TP=2, SP on and off, "profiled", against one process, same weights:
    train.py's build and loop for the GPT and llama-tiny (GQA with 2 key/value heads split over TP 2, 5 blocks: 7
    pipeline layers on 2 stages), each with and without SP, in one launch."""
    from ds_pipe_ext.models import family_of
    from ds_pipe_ext.runner import launch, write_config

    runs, want = [], {}
    ds = write_config(tmp_path / "ds.json", base="ds_pp2_tp2_sp.json",
                      tensor_parallel={"size": 2, "sequence_parallel": True})
    no_sp = write_config(tmp_path / "no-sp.json", base="ds_pp2_tp2_sp.json",
                         tensor_parallel={"size": 2, "sequence_parallel": False})
    for name in MODELS:
        cfg = tiny(False, name)
        family = family_of(cfg)
        init = tmp_path / f"init-{name}.pt"
        torch.save(family.sequential(family.layer_specs(cfg), family.loss_fn(cfg), base_seed=99,
                                     recompute=False).state_dict(), init)
        want[name] = serial_reference(cfg, init, STEPS)
        runs += ["--run", f"{name}={init}",
                 "--run", f"{name} without sp: --model {name} --init-from {init} --deepspeed_config {no_sp}"]
    # without SP, llama-tiny once more under a recompute mode per layer (issue 36): the same losses
    modes = ["none", "selective", "full", "none", "full", "selective", "none"]
    per_layer = write_config(tmp_path / "per-layer.json", base="ds_pp2_tp2_sp.json",
                             tensor_parallel={"size": 2, "sequence_parallel": False}, train={"recompute": modes})
    runs += ["--run", f"per-layer recompute: --model llama-tiny --init-from {tmp_path / 'init-llama-tiny.pt'} "
                      f"--deepspeed_config {per_layer}"]
    # recompute="auto": the modes chosen with the analytic split under a cap that no split fits without
    # recompute; and under a cap nothing fits, the same error on every rank naming the smallest cap
    cap = auto_recompute_cap()
    for name, gib in (("auto", cap), ("auto infeasible", cap / 100)):
        file = name.replace(" ", "-")
        auto = write_config(tmp_path / f"{file}.json", base="ds_pp2_tp2_sp.json",
                            tensor_parallel={"size": 2, "sequence_parallel": False}, train={"recompute": "auto"},
                            pipeline={"partition_method": "analytic", "memory_cap_gib": gib,
                                      "instrument": {"enabled": True, "run_dir": str(tmp_path / file)}})
        runs += ["--run", f"{name}: --model llama-tiny --init-from {tmp_path / 'init-llama-tiny.pt'} "
                          f"--deepspeed_config {auto}"]
    proc, ranks = launch(4, ds, "--steps", str(STEPS), *runs, out_dir=tmp_path, cwd=tmp_path,
                         script="tests/models_in_turn.py", timeout=360)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, (want_losses, want_norms) = ranks[0]["runs"]["per-layer recompute"], want["llama-tiny"]
    assert got["recompute"] == modes
    built = {int(i): m for r in ranks.values() for i, m in r["runs"]["per-layer recompute"]["recomputed_layers"].items()}
    assert built == {i: m for i, m in enumerate(modes) if m != "none"}  # as DeepSpeed and the layers run them
    assert ranks[0]["runs"]["llama-tiny without sp"]["recomputed_layers"] == {}
    from ds_pipe_ext.instrument.report import build_report, render_report_table
    from ds_pipe_ext.instrument.rundir import RunDir

    chosen = RunDir(tmp_path / "auto").read_predicted().layer_recompute
    assert len(chosen) == 7 and set(chosen) - {"none"}, chosen
    built = {int(i): m for r in ranks.values() for i, m in r["runs"]["auto"]["recomputed_layers"].items()}
    assert built == {i: m for i, m in enumerate(chosen) if m != "none"}
    got = ranks[0]["runs"]["auto"]
    assert got["losses"][0] == pytest.approx(want_losses[0], rel=1e-5)
    assert got["losses"] == pytest.approx(want_losses, rel=1e-4)
    table = render_report_table(build_report(tmp_path / "auto"))
    assert "recompute per stage" in table and "of cap" in table
    error = ranks[0]["runs"]["auto infeasible"]["error"]
    assert "the smallest cap that admits a partition is" in error
    assert all(r["runs"]["auto infeasible"]["error"] == error for r in ranks.values())
    assert got["losses"][0] == pytest.approx(want_losses[0], rel=1e-5)
    assert got["grad_norms"][0] == pytest.approx(want_norms[0], rel=1e-5)
    assert got["losses"] == pytest.approx(want_losses, rel=1e-4)
    for name in MODELS:
        for run, sp in ((name, True), (f"{name} without sp", False)):
            got = ranks[0]["runs"][run]
            want_losses, want_norms = want[name]
            assert (got["model"], got["tensor_parallel"], got["sequence_parallel"]) == (name, 2, sp)
            assert got["losses"][0] == pytest.approx(want_losses[0], rel=1e-5), run
            assert got["grad_norms"][0] == pytest.approx(want_norms[0], rel=1e-5), run
            assert got["losses"] == pytest.approx(want_losses, rel=1e-4), run
            assert all(r["runs"][run]["parts"] == got["parts"] for r in ranks.values())


@pytest.mark.multiprocess
def test_analytic_activations_match_tp2_shards():
    """Each layer as TP rank 0 runs it (TP=2, SP off and on): analytic bytes within 3% of the hooks' count."""
    from ds_pipe_ext.costs.estimate import EstimateRequest, estimate_layers
    from ds_pipe_ext.costs.hardware import DeviceSpec
    from ds_pipe_ext.models.gpt_config import GPTConfig
    from ds_pipe_ext.parallel.probe import tp_activation_bytes

    cfg = GPTConfig.from_dict({**load_model_config("bench-cpu").to_dict(), "seq_len": 128, "vocab_size": 8000,
                               "vocab_pad_to": 256}, name="probe")
    cases = [{"model": cfg.to_dict(), "b": 2, "sp": sp} for sp in (False, True)]
    cpu = DeviceSpec("cpu", {"fp32": 1e11}, {"fp32": 1e10}, 1e10, 1e10, 1e10, 2**34, gpus_per_node=1)
    for case, measured in zip(cases, tp_activation_bytes(cases)):
        est = estimate_layers(cfg, EstimateRequest(2, 128, tp=2, sp=case["sp"], dtype="fp32"), cpu)
        for got, want in zip([est[0], est[1], est[-1]], measured):
            assert got["activation_bytes"] == pytest.approx(want, rel=0.03), (case["sp"], got["name"])
