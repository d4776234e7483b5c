"""The Mixture-of-Experts family trains: DeepSpeed's MoE layer against a plain-torch reference of its routing,
in one process and through ``deepspeed --num_gpus 4`` as PP 2 x DP 2 x EP 2.

The reference (``moe.reference_routing``) shares only the parameters with DeepSpeed's layer: it gathers each
expert's tokens itself, so a wrong dispatch, all-to-all or combine changes the loss.  Experts start distinct
(seeded by their global id), so routing a token to the wrong expert does too."""

import json
import math

import pytest
import torch

from ds_pipe_ext.models import family_of, get_family, load_model
from ds_pipe_ext.models.config import ModelConfigError
from ds_pipe_ext.train.data import SyntheticTokens

MOE = get_family("moe")
HYBRID = get_family("hybrid")


def flat_grad(model) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_deepspeed_moe_layer_equals_the_reference_routing(top_k):
    cfg = load_model("moe-tiny", top_k=top_k, norm_topk_prob=top_k > 1)
    ours = MOE.sequential(MOE.layer_specs(cfg), MOE.loss_fn(cfg), base_seed=3, recompute=False)
    ref = MOE.sequential(MOE.layer_specs(cfg, reference=True), MOE.loss_fn(cfg), base_seed=3, recompute=False)
    a, b = ours.state_dict(), ref.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    experts = ours.layers[2].mlp.moe.deepspeed_moe.experts.deepspeed_experts
    assert not torch.equal(experts[0].down.weight, experts[1].down.weight)  # re-initialised apart
    x, y = next(SyntheticTokens(cfg.vocab_size, 2, cfg.seq_len, seed=1))
    loss_a, loss_b = ours(x, y), ref(x, y)
    loss_a.backward()
    loss_b.backward()
    assert loss_a.item() == pytest.approx(loss_b.item(), rel=1e-6)
    terms = {k: v.item() for k, v in ours.loss_fn.additional_losses().items()}
    assert loss_a.item() == pytest.approx(terms["lm_loss"] + cfg.aux_loss_coef * terms["moe_aux_loss"], rel=1e-6)
    assert terms["moe_aux_loss"] > 3 * 0.99  # three MoE blocks, each >= 1 (1 is a perfectly balanced router)
    ga, gb = flat_grad(ours), flat_grad(ref)
    assert ((ga - gb).norm() / gb.norm()).item() < 1e-5
    gate = ours.layers[2].mlp.moe.deepspeed_moe.gate.wg.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0  # the router learns (aux and combine weights)


def test_a_layer_built_for_ep_is_profiled_alone_without_a_collective():
    """No process group exists here, so any collective would raise: the EP 2 layer runs DeepSpeed's dispatch
    with its 2 local experts taking 2 experts' tokens each, which the reference reproduces, and its profile
    counts its own experts' bytes only."""
    import torch.distributed as dist

    from ds_pipe_ext.costs.profiler import ProfileSettings, profile_layers

    assert not dist.is_initialized()
    cfg = load_model("moe-tiny")
    torch.manual_seed(0)
    block = MOE.layer_specs(cfg, ep=2)[2].build()
    x = torch.randn(cfg.seq_len, 2, cfg.hidden)
    y, aux, counts = block.mlp(x)
    block.mlp.reference = True
    y_ref, aux_ref, _ = block.mlp._reference(x, fold=True)
    assert torch.allclose(y, y_ref + block.mlp.shared(x), atol=1e-6) and aux.item() == pytest.approx(aux_ref.item())
    assert int(counts.sum()) == cfg.top_k * x.shape[0] * x.shape[1]
    t = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    settings = ProfileSettings(cache_dir=None, warmup=0, repeats=1, progress=False)
    one, two = (profile_layers(MOE.layer_specs(cfg, ep=ep), t[:, :-1], labels=t[:, 1:], loss_fn=MOE.loss_fn(cfg),
                               settings=settings)[2] for ep in (1, 2))
    expert = 3 * cfg.hidden * cfg.expert_ffn * 4  # one SwiGLU expert's fp32 bytes
    assert (one.expert_param_bytes, two.expert_param_bytes) == (4 * expert, 2 * expert)
    assert one.param_bytes - two.param_bytes == 2 * expert
    assert one.activation_bytes == two.activation_bytes  # the same tokens pass through experts either way


def test_expert_states_partition_over_the_expert_data_parallel_group():
    from ds_pipe_ext.costs.types import LayerCost
    from ds_pipe_ext.costs.zero import layer_states_by_rule

    layer = LayerCost("moe", 1.0, 1.0, param_bytes=4 * 1000, grad_bytes=4 * 1000, expert_param_bytes=4 * 600)
    (z1,) = layer_states_by_rule([layer], stage=1, dp=4, ep=2)
    assert z1.param_bytes == 4 * 1000
    assert z1.grad_bytes == round(4 * 400 / 4 + 4 * 600 / 2)  # dense over dp 4, experts over dp / ep = 2
    assert z1.optimizer_bytes == round(12 * 400 / 4 + 12 * 600 / 2)
    assert layer_states_by_rule([layer], stage=1, dp=4)[0].grad_bytes == 4 * 1000 / 4


@pytest.mark.parametrize("fields, match", [
    ({"norm_topk_prob": False}, "renormalises the top-k gate weights; set norm_topk_prob = true"),
    ({"top_k": 1, "norm_topk_prob": True}, "does not renormalise .* set norm_topk_prob = false"),
    ({"tie_embeddings": True}, "tied embeddings are not built for the moe family"),
])
def test_what_deepspeed_moe_cannot_train_is_named(fields, match):
    with pytest.raises(ModelConfigError, match=match):
        MOE.layer_specs(load_model("moe-tiny", **fields))


def test_sequence_parallel_moe_layers_and_slots_tp_cannot_split_are_refused():
    with pytest.raises(ModelConfigError, match="sequence parallelism of a Mixture-of-Experts model"):
        MOE.layer_specs(load_model("moe-tiny"), MOE.tensor_parallel(2, True))
    from ds_pipe_ext.models.moe import RoutedMLP

    cfg = load_model("moe-tiny", capacity_factor=1.25, top_k=2)
    layer = RoutedMLP(cfg)
    layer.tp = 2  # as built under TP 2: DeepSpeed would split each expert's slots over 2 ranks
    x = torch.zeros(1, 36, cfg.hidden)  # ceil(36 / 4 x 1.25 x 2) = 23 slots an expert
    with pytest.raises(ModelConfigError, match=r"= 23 slots an expert, which tp = 2 does not divide"):
        layer._check_tp_capacity(x)
    layer._check_tp_capacity(torch.zeros(1, 32, cfg.hidden))  # 20 slots: 10 a TP rank


# a hybrid model whose two stages (parts 0, 3, 6) each hold an E layer: Mamba-2 with 2 groups and attention with 2
# key/value heads (TP 2 splits both), 4 dropless experts a layer
HYBRID_MOE = """family = "hybrid"
vocab_size = 512
hidden = 64
layers = 4
pattern = "ME*E"
heads = 4
kv_heads = 2
ffn_hidden = 128
seq_len = 32
mamba_heads = 4
mamba_head_dim = 16
ssm_state = 16
n_groups = 2
chunk = 8
experts = 4
top_k = 2
expert_ffn_hidden = 32
shared_ffn_hidden = 32
"""


def moe_reference(cfg, weights_path, steps: int, *, dp: int, micro_batch: int, gas: int, seed: int = 1234,
                  lr: float = 3e-4, of_dp: int | None = None, clip: float | None = 1.0):
    """What PP x DP x EP computes, in one process: each DP rank's stream, each micro-batch routed (and its
    load-balancing loss taken) on its own tokens as the ranks do; the step's gradient is the mean over
    the dp x gas micro-batches, and every expert is counted once in the gradient norm; ``clip``: the
    gradient clipped to that norm (DeepSpeed's default gradient_clipping, 1.0), the norm before it recorded."""
    family = family_of(cfg)
    model = family.sequential(family.layer_specs(cfg, reference=True), family.loss_fn(cfg), base_seed=None,
                              recompute=False)
    model.load_state_dict(torch.load(weights_path))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    streams = [SyntheticTokens(cfg.vocab_size, micro_batch, cfg.seq_len, seed=seed + 1000, dp_rank=r, dp=of_dp or dp)
               for r in range(dp)]  # of_dp: the first dp ranks' streams of a run over of_dp ranks
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        for data in streams:
            for _ in range(gas):
                loss = model(*next(data))
                (loss / (gas * dp)).backward()
                total += loss.item()
        norms.append(float(flat_grad(model).double().norm()))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        losses.append(total / (gas * dp))
        opt.step()
    return losses, norms


@pytest.mark.multiprocess
@pytest.mark.usefixtures("forked_ranks")
def test_pp2_dp2_ep2_parity_and_resume_through_deepspeed(tmp_path, capfd):
    """One launch of deepspeed --num_gpus 4, five builds: 2 stages x 2 data-parallel ranks, each MoE layer's 4
    experts split over EP 2, from the weights of one process (first loss and gradient norm within 1e-5,
    later losses within 1e-4); under another split, instrumented, 2 steps saved (each stage's expert loads
    and loss terms in the run directory) and resumed for the third (its loss within 1e-6 of the
    uninterrupted run's); a resume under another split moves the full states (the same losses), one under
    another EP degree is refused naming the saved one; the ZeRO-1 rule on every rank; the ds.json `plan` emits for EP 2, trained as emitted; and ZeRO-2
    without a pipeline (DP 4 x EP 2) against one process; PP 2 x TP 2 at EP 2 and 1 (ZeRO-0 and ZeRO-1) against one
    process, and a hybrid model's E layers at PP 2 x TP 2 x EP 2 against one process."""
    from ds_pipe_ext.cli import main
    from ds_pipe_ext.runner import launch, write_config

    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", "moe-tiny", "--gpus", "4", "--device", "cpu", "--global-batch", "8",
                 "--only", "pp=2,dp=2,ep=2", "--emit-ds-config", str(plan)]) == 0
    capfd.readouterr()
    emitted = json.loads(plan.read_text())
    assert emitted["moe"] == {"ep_size": 2} and emitted["pipeline"]["stages"] == 2

    cfg = load_model("moe-tiny")
    init = tmp_path / "init.pt"
    torch.save(MOE.sequential(MOE.layer_specs(cfg), MOE.loss_fn(cfg), base_seed=99, recompute=False).state_dict(),
               init)
    steps, mb, gas = 3, 2, 2
    want_losses, want_norms = moe_reference(cfg, init, steps, dp=2, micro_batch=mb, gas=gas)
    common = dict(train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=gas,
                  train={"model": "moe-tiny", "steps": steps})
    ds = write_config(tmp_path / "ds.json", pipeline={"stages": 2, "partition_method": "parts:0,3,6"},
                      moe={"ep_size": 2}, **common)
    ep1 = write_config(tmp_path / "ep1.json", pipeline={"stages": 2, "partition_method": "parts:0,3,6"},
                       moe={"ep_size": 1}, **common)
    zero1 = write_config(tmp_path / "zero1.json", pipeline={"stages": 2, "partition_method": "parts:0,3,6"},
                         moe={"ep_size": 2}, zero_optimization={"stage": 1}, **common)
    zero2 = write_config(tmp_path / "zero2.json", pipeline=None, moe={"ep_size": 2}, zero_optimization={"stage": 2},
                         **common)
    tp2 = {ep: write_config(tmp_path / f"tp2-ep{ep}.json", pipeline={"stages": 2, "partition_method": "parts:0,3,6"},
                            tensor_parallel={"size": 2, "sequence_parallel": False}, moe={"ep_size": ep}, **common)
           for ep in (1, 2)}
    # a hybrid model's E layers under TP 2 (and a Mamba-2 layer, attention) in both stages, experts over EP 2
    hybrid_cfg = tmp_path / "hybrid-moe.toml"
    hybrid_cfg.write_text(HYBRID_MOE)
    hybrid = load_model(str(hybrid_cfg))
    hybrid_init = tmp_path / "hybrid-init.pt"
    torch.save(HYBRID.sequential(HYBRID.layer_specs(hybrid), HYBRID.loss_fn(hybrid), base_seed=5,
                                 recompute=False).state_dict(), hybrid_init)
    hybrid_tp2 = write_config(tmp_path / "hybrid-tp2.json", pipeline={"stages": 2, "partition_method": "parts:0,3,6"},
                              tensor_parallel={"size": 2, "sequence_parallel": False}, moe={"ep_size": 2},
                              **{**common, "train": {"model": str(hybrid_cfg), "steps": steps}})
    tp2_zero1 = write_config(tmp_path / "tp2-zero1.json", pipeline={"stages": 2, "partition_method": "parts:0,3,6"},
                             tensor_parallel={"size": 2, "sequence_parallel": False}, moe={"ep_size": 1},
                             zero_optimization={"stage": 1}, **common)
    modes = ["none", "full", "selective", "full", "selective", "none"]  # saved without recompute, resumed with
    per_layer = write_config(tmp_path / "per-layer.json", pipeline={"stages": 2, "partition_method": "parts:0,3,6"},
                             moe={"ep_size": 2}, **{**common, "train": {**common["train"], "recompute": modes}})
    ckpt = tmp_path / "ckpt"
    # parity's stage 0 holds no MoE layer (embedding and the dense block): every build after it hangs unless
    # every rank makes DeepSpeed's expert groups (compat.engine.ensure_expert_groups)
    runs = ["--run", f"parity: --init-from {init} --partition-method parts:0,2,6",
            "--run", f"first two: --init-from {init} --steps 2 --save {ckpt} --instrument {tmp_path / 'run'}",
            "--run", f"resumed: --load {ckpt} --steps 1",
            "--run", f"resumed per layer: --load {ckpt} --steps 1 --deepspeed_config {per_layer}",
            "--run", f"other split: --load {ckpt} --steps 1 --partition-method parts:0,4,6",
            "--run", f"other ep: --load {ckpt} --steps 1 --deepspeed_config {ep1}",
            "--run", f"zero1: --init-from {init} --steps 1 --deepspeed_config {zero1} --instrument {tmp_path / 'z1'}",
            "--run", f"plan: --steps 1 --deepspeed_config {plan}",
            "--run", f"zero2: --init-from {init} --steps 1 --deepspeed_config {zero2}",
            "--run", f"tp2 ep2: --init-from {init} --deepspeed_config {tp2[2]}",
            "--run", f"tp2 ep1: --init-from {init} --deepspeed_config {tp2[1]}",
            "--run", f"tp2 zero1: --init-from {init} --deepspeed_config {tp2_zero1}",
            "--run", f"hybrid tp2: --init-from {hybrid_init} --deepspeed_config {hybrid_tp2}"]
    proc, ranks = launch(4, ds, "--steps", str(steps), *runs, out_dir=tmp_path, cwd=tmp_path,
                         script="tests/models_in_turn.py", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = ranks[0]["runs"]
    run = got["parity"]
    assert run["parts"] == [0, 2, 6] and run["dp"] == 2 and all(math.isfinite(x) for x in run["losses"])
    assert run["losses"][0] == pytest.approx(want_losses[0], rel=1e-5)
    assert run["grad_norms"][0] == pytest.approx(want_norms[0], rel=1e-5)
    assert run["losses"] == pytest.approx(want_losses, rel=1e-4)
    # another split, instrumented: the same math
    assert got["first two"]["parts"] == [0, 3, 6]
    assert got["first two"]["losses"] == pytest.approx(run["losses"][:2], rel=1e-6)
    # the run directory: each stage's routers' loads per step (dropless: nothing dropped) and the loss's terms
    from ds_pipe_ext.instrument.rundir import RunDir

    logs = {r: [json.loads(line) for line in RunDir(tmp_path / "run").rank_path(r).read_text().splitlines()]
            for r in range(4)}
    routed = mb * cfg.seq_len * gas * cfg.top_k  # a step's token-expert routes in one routed layer, per DP rank
    for rank, layers in [(0, ["2"]), (1, ["2"]), (2, ["3", "4"]), (3, ["3", "4"])]:
        for rec in logs[rank]:
            assert sorted(rec["expert_load"]) == layers and rec["dropped_token_fraction"] == 0.0
            assert all(sum(load) == routed and len(load) == cfg.experts for load in rec["expert_load"].values())
            terms = rec["loss_terms"]
            assert terms["lm_loss"] + cfg.aux_loss_coef * terms["moe_aux_loss"] == pytest.approx(rec["loss"], rel=1e-5)
    assert got["resumed"]["start_step"] == 2 and got["resumed"]["losses"] == pytest.approx(run["losses"][2:], rel=1e-6)
    # a checkpoint saved without recompute resumes under a recompute mode per layer (nothing is wrapped)
    again = got["resumed per layer"]
    assert again["start_step"] == 2 and again["losses"] == pytest.approx(run["losses"][2:], rel=1e-6)
    assert {int(i): m for r in ranks.values() for i, m in r["runs"]["resumed per layer"]["recomputed_layers"].items()} \
        == {1: "full", 2: "selective", 3: "full", 4: "selective"}
    # the report: each routed layer's tokens over the summarised step (step 2) from both data-parallel ranks
    from ds_pipe_ext.instrument.report import build_report, render_report_table

    rep = build_report(tmp_path / "run")
    assert [(r["stage"], r["layer"], r["routed"]) for r in rep["routers"]] == [(0, 2, 2 * routed), (1, 3, 2 * routed),
                                                                                (1, 4, 2 * routed)]
    assert all(r["max_over_mean"] >= 1 and r["dropped_fraction"] == 0 for r in rep["routers"])
    assert "routers (Mixture-of-Experts)" in render_report_table(rep) and "moe_aux_loss" in render_report_table(rep)
    # each micro-batch's busiest expert over the mean, read back as the analytic experts' padding factor
    from ds_pipe_ext.instrument.report import measured_expert_imbalance

    imbalance = measured_expert_imbalance(tmp_path / "run")
    assert rep["summary"]["expert_imbalance"] == pytest.approx(imbalance) and "--expert-imbalance" in render_report_table(rep)
    per_step = [rec["expert_imbalance"] for r in range(4) for rec in logs[r] if "expert_imbalance" in rec]
    assert len(per_step) == 8  # 4 ranks x 2 steps, every rank holding routed layers
    assert 1 < imbalance <= cfg.experts and all(1 <= x <= cfg.experts for x in per_step)
    estimates = {}
    for factor in ("1", str(tmp_path / "run")):
        assert main(["estimate", "--model", "moe-tiny", "--device", "cpu", "--dtype", "fp32", "--json",
                     "--expert-imbalance", factor]) == 0
        estimates[factor] = json.loads(capfd.readouterr().out)
    routed = [i for i, layer in enumerate(estimates["1"]["layers"]) if layer["expert_params"]]
    for i in routed:
        balanced, measured = (estimates[f]["layers"][i] for f in ("1", str(tmp_path / "run")))
        assert measured["fwd_s"] > balanced["fwd_s"] and measured["fwd_flops"] > balanced["fwd_flops"]
    # model states at the step, measured on every rank, against the ZeRO rule over dp (dense) and dp / ep
    # (experts) that the partition's records carry, ZeRO-0 and ZeRO-1.  Under ZeRO-1 DeepSpeed steps its
    # parameter groups one at a time: the gradients peak at the dense group's step, above the sum of the
    # groups' partitions by the dense partition's fp32 copy (``expert_parallel_states``' rule, per rank)
    from ds_pipe_ext.compare.predict import expert_groups, model_shape
    from ds_pipe_ext.costs.zero import expert_parallel_states

    shape = model_shape(cfg)
    for run_dir in ("run", "z1"):
        rd = RunDir(tmp_path / run_dir)
        predicted = rd.read_predicted()
        for rank in range(4):
            rec = json.loads(rd.rank_path(rank).read_text().splitlines()[-1])
            start, stop = predicted.parts[rec["stage"]], predicted.parts[rec["stage"] + 1]
            layers = predicted.layer_costs[start:stop]
            for kind in ("param_bytes", "optimizer_bytes") + (("grad_bytes",) if run_dir == "run" else ()):
                assert rec[kind] == sum(getattr(c, kind) for c in layers), (run_dir, rank, kind)
            if run_dir == "z1":
                assert rec["stage"] == rank // 2  # DeepSpeed's grid: pipe x data
                dense, local = expert_groups(shape, start, stop, ep=2)
                ruled = expert_parallel_states(dense, local, dp=2, ep=2, stage=1, rank=rank % 2)
                assert rec["grad_bytes"] == ruled.grad_bytes, rank
                assert rec["grad_bytes"] > sum(c.grad_bytes for c in layers)  # the additive rule: below
    # without a pipeline: ZeRO-2 over 4 data-parallel ranks, experts over EP 2, against one process (a
    # data-parallel run reports rank 0's own micro-batches: its stream alone, routed through the all-to-all)
    assert got["zero2"]["mode"] == "data-parallel zero=2" and got["zero2"]["dp"] == 4
    rank0 = moe_reference(cfg, init, 1, dp=1, micro_batch=mb, gas=gas, of_dp=4)[0][0]  # rank 0's stream of 4
    assert got["zero2"]["losses"][0] == pytest.approx(rank0, rel=1e-5)
    # TP 2 x PP 2 (one data-parallel replica): each TP rank runs half of every expert's slots, the experts
    # over EP 2 (the TP pair: ep consecutive ranks) or whole on both TP ranks (EP 1: their gradients summed
    # over the pair); against one process on the one replica's stream
    one_replica = moe_reference(cfg, init, steps, dp=1, micro_batch=mb, gas=gas)
    for name in ("tp2 ep2", "tp2 ep1"):
        tp_run = got[name]
        assert tp_run["dp"] == 1 and tp_run["parts"] == [0, 3, 6], name
        assert tp_run["losses"][0] == pytest.approx(one_replica[0][0], rel=1e-5), name
        assert tp_run["grad_norms"][0] == pytest.approx(one_replica[1][0], rel=1e-5), name
        assert tp_run["losses"] == pytest.approx(one_replica[0], rel=1e-4), name
        assert tp_run["grad_norms"] == pytest.approx(one_replica[1], rel=1e-4), name
    # ZeRO-1: the experts' states partitioned over their expert-data-parallel group, the TP pair at EP 1
    assert got["tp2 zero1"]["losses"] == pytest.approx(one_replica[0], rel=1e-4)
    # the hybrid family's E layers under TP 2 x EP 2, beside a TP-split Mamba-2 layer and attention: one process
    want = moe_reference(hybrid, hybrid_init, steps, dp=1, micro_batch=mb, gas=gas)
    assert got["hybrid tp2"]["parts"] == [0, 3, 6] and got["hybrid tp2"]["dp"] == 1
    assert got["hybrid tp2"]["losses"][0] == pytest.approx(want[0][0], rel=1e-5)
    assert got["hybrid tp2"]["grad_norms"][0] == pytest.approx(want[1][0], rel=1e-5)
    assert got["hybrid tp2"]["losses"] == pytest.approx(want[0], rel=1e-4)
    planned = got["plan"]
    assert "parts:" + ",".join(map(str, planned["parts"])) == emitted["pipeline"]["partition_method"]
    assert planned["dp"] == 2 and math.isfinite(planned["losses"][0])
    # another split moves the full states, experts by their global names: the same losses
    assert got["other split"]["parts"] == [0, 4, 6] and got["other split"]["start_step"] == 2
    assert got["other split"]["losses"] == pytest.approx(run["losses"][2:], rel=1e-5)
    assert all(r["runs"]["other ep"] == got["other ep"] for r in ranks.values())  # the same verdict on every rank
    assert "written with ep = 2, this run has 1: each expert-parallel rank holds its own" in got["other ep"]["error"]


@pytest.mark.parametrize("fields", [{}, {"shared_ffn_hidden": 0}, {"top_k": 3, "experts": 8, "norm_topk_prob": True},
                                    {"shared_gate": True}, {"top_k": 1, "norm_topk_prob": False}])
def test_analytic_moe_block_matches_the_saved_tensors(fields):
    """A routed block's analytic saved bytes against the profiler's saved-tensor count, fp32 on this CPU,
    within 1% (the Llama family's target is 3%), at the block's own largest expert load (a dropless layer
    pads every expert to it); its weights exact, the experts' share apart."""
    from ds_pipe_ext.costs.estimate import EstimateRequest, analytic_layer_costs
    from ds_pipe_ext.costs.hardware import get_device
    from ds_pipe_ext.costs.probes import saved_activation_bytes

    cfg = load_model("moe-tiny", **fields)
    b = 4
    torch.manual_seed(0)
    block = MOE.layer_specs(cfg)[2].build()
    x = torch.randn(cfg.seq_len, b, cfg.hidden, requires_grad=True)
    aux = torch.zeros(1, requires_grad=True)
    saved, _ = saved_activation_bytes(lambda: block((x, aux)), list(block.parameters()))
    imbalance = int(block.tokens_per_expert.max()) / (cfg.top_k * b * cfg.seq_len / cfg.experts)
    assert imbalance >= 1
    req = EstimateRequest(b, cfg.seq_len, dtype="fp32", expert_imbalance=imbalance)
    analytic = analytic_layer_costs(cfg, req, get_device("cpu"))[2]
    assert analytic.activation_bytes == pytest.approx(saved, rel=0.01)
    params = sum(p.numel() * 4 for p in block.parameters())
    experts = sum(p.numel() * 4 for p in block.mlp.moe.deepspeed_moe.experts.parameters())
    assert (analytic.param_bytes, analytic.expert_param_bytes) == (params, experts)


def test_analytic_costs_under_expert_parallelism():
    """At ep 2 a rank holds half the experts, does the same expert work (its experts take twice their own
    share of slots) and adds two all-to-alls of its slots each way."""
    from dataclasses import replace

    from ds_pipe_ext.costs.estimate import EstimateRequest, estimate_layers
    from ds_pipe_ext.costs.hardware import get_device

    cfg = load_model("moe-tiny")
    # at a measured imbalance of 1 (the default's slots grow with ep: the busiest over the EP group, tests/test_moe.py)
    one, two = (estimate_layers(cfg, EstimateRequest(2, 32, ep=ep, expert_imbalance=1.0), get_device("h100"))
                for ep in (1, 2))
    assert two[2]["expert_params"] * 2 == one[2]["expert_params"] > 0
    assert two[2]["fwd_flops"] == one[2]["fwd_flops"] and two[1] == one[1]  # the dense block is untouched
    slots = 4 * math.ceil(2 * 2 * 32 / 4)  # E x C at imbalance 1
    assert two[2]["comm_bytes"] == 4 * slots * cfg.hidden * 2 and one[2]["comm_bytes"] == 0
    # the all-to-alls are the added time (a rank's experts launch half the kernels, which a GPU's host dispatches)
    assert two[2]["class_s"]["communication"] > 0 == one[2]["class_s"]["communication"]
    model = replace(MOE.cost_model(cfg), expert_parallel=2)
    costs = model.layer_costs(torch.zeros(2, 32, dtype=torch.long), tp=1, device=get_device("h100"), dtype="bf16")
    assert costs[2].expert_param_bytes == two[2]["expert_params"] * 2


def test_the_expert_load_meter_counts_each_micro_batch_once_and_the_dropped_tokens():
    """A capacity factor of 1 over 4 experts, top-2: tokens beyond an expert's capacity are dropped; a forward
    without gradients (a reentrant checkpoint's first pass) is not counted."""
    from ds_pipe_ext.instrument.experts import ExpertLoadMeter

    cfg = load_model("moe-tiny", capacity_factor=1.0)
    model = MOE.sequential(MOE.layer_specs(cfg), MOE.loss_fn(cfg), base_seed=3, recompute=False)
    meter = ExpertLoadMeter(model)
    assert sorted(meter.blocks) == ["2", "3", "4"]
    x, y = next(SyntheticTokens(cfg.vocab_size, 2, cfg.seq_len, seed=1))
    with torch.no_grad():
        model(x, y)
    model(x, y)
    model(x, y)
    step = meter.read()
    routes = 2 * 2 * cfg.seq_len * cfg.top_k  # two micro-batches counted
    assert all(sum(load) == routes for load in step["expert_load"].values())
    capacity = math.ceil(2 * cfg.seq_len / cfg.experts * 1.0 * cfg.top_k)
    dropped = sum(max(0, c - 2 * capacity) for load in step["expert_load"].values() for c in load)
    assert step["dropped_token_fraction"] >= dropped / (3 * routes) and step["dropped_token_fraction"] > 0
    assert meter.read()["expert_load"] == {}  # the next step starts from zero
    meter.remove()
