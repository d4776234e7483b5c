"""The cluster's network (costs.network), each group placed from the rank order, and NCCL's cost model
(costs.nccl) against values computed by hand from NCCL 2.30.7's tuning.cc and search.cc."""

from __future__ import annotations

import math

import pytest

from ds_pipe_ext.costs.hardware import DEVICES, get_device
from ds_pipe_ext.costs.nccl import NCCL_2_8, collective
from ds_pipe_ext.costs.network import ClusterNetwork, NetworkError, Placement, system_for, with_overrides
from ds_pipe_ext.layout import Layout
from ds_pipe_ext.models import load_model_config
from ds_pipe_ext.parallel.topology import rank_groups
from ds_pipe_ext.plan.machine import Cluster, plan_cluster
from ds_pipe_ext.plan.model import PlanModel
from ds_pipe_ext.plan.space import PlanError

H100, A100 = system_for(DEVICES["h100-sxm"]), system_for(DEVICES["a100-80gb"])
GIB, MIB = 2**30, 2**20


# -- the datasheet systems and their refusals ---------------------------------------------------------------
def test_the_devices_imply_their_dgx_systems():
    assert (H100.name, H100.gpus_per_node, H100.nics_per_node, H100.nic_bandwidth, H100.fabric) == (
        "DGX H100", 8, 8, 50e9, "nvswitch")
    assert (A100.name, A100.compute_capability, A100.nic_bandwidth) == ("DGX A100", 80, 25e9)
    assert system_for(DEVICES["h100-nvl"]).fabric == "nvlink-pairs"
    assert system_for(DEVICES["h100-pcie"]).fabric == "pcie"
    # what NCCL's search gives them: 12 channels of 30 (H100) or 20 (A100) GB/s inside a node (18 or 12 NVLinks at
    # 20.6 or 20.0 GB/s), 8 x 45 GB/s across DGX H100 nodes (8 x 48 would exceed 371 GB/s of NVLink), 8 x 24 on A100
    from ds_pipe_ext.costs.nccl import _inter_channels, _intra_channels

    assert _intra_channels(H100, 8) == (12, 30.0) and _intra_channels(A100, 8) == (12, 20.0)
    assert _inter_channels(H100, 8) == (8, 45.0) and _inter_channels(H100, 1) == (1, 48.0)
    assert _inter_channels(A100, 8) == (8, 24.0)


@pytest.mark.parametrize("option, value, match", [
    ("gpus_per_node", 0, "--gpus-per-node 0: must be a positive number"),
    ("nics_per_node", 0, "--nics-per-node 0"),
    ("inter_node_gbs", -5, "--inter-node-gbs -5"),
    ("intra_node_gbs", 0, "--intra-node-gbs 0"),
    ("gpus_per_node", 2.5, "--gpus-per-node 2.5: must be a whole number"),
])
def test_a_bad_description_is_refused_naming_its_option(option, value, match):
    with pytest.raises(NetworkError, match=match):
        with_overrides(H100, **{option: value})
    with pytest.raises(PlanError, match=match):
        plan_cluster(DEVICES["h100-sxm"], **{option: value})
    with pytest.raises(NetworkError, match="nic_bandwidth"):
        ClusterNetwork(8, 450e9, 8, 0.0)


def test_fewer_gpus_than_a_node_holds_is_normal_and_nics_follow_the_gpus_a_node():
    four = with_overrides(H100, gpus_per_node=4)
    assert (four.gpus_per_node, four.nics_per_node) == (4, 4)
    assert Placement.of(range(4), 8) == Placement(4, 1, 4, 4)


# -- each group placed -----------------------------------------------------------------------------------------
def _placed(pp, tp, dp, ep=1, cluster=H100):
    from ds_pipe_ext.plan.groups import placements

    return placements(cluster, pp, tp, dp, ep)


def test_tp8_dp4_over_four_nodes():
    p = _placed(1, 8, 4)
    assert p["tp"] == Placement(8, 1, 8, 8)  # a node each
    assert p["dp"] == Placement(4, 4, 1, 1)  # one rank a node: one rail


def test_tp1_dp64_over_eight_nodes():
    p = _placed(1, 1, 64)
    assert p["dp"] == Placement(64, 8, 8, 8)  # 8 a node: 8 rails at once


def test_tp2_dp8_pp4():
    p = _placed(4, 2, 8)
    assert p["tp"] == Placement(2, 1, 2, 2)
    assert p["dp"] == Placement(8, 2, 4, 4)  # ranks 2 apart: 16 a stage, two nodes, 4 of the group on each
    assert p["pp_pair"] == Placement(2, 2, 1, 1)  # neighbours 16 ranks apart
    assert p["tied"] == Placement(2, 2, 1, 1)


def test_ep8_under_tp2_stays_in_a_node_as_deepspeeds_moe_layer_groups_it():
    groups = rank_groups(1, 2, 8, ep=8)
    assert groups["ep"][:2] == [list(range(8)), list(range(8, 16))]  # ep consecutive ranks: TP ranks first
    assert sorted(groups["expert_dp"]) == [[r, r + 8] for r in range(8)]
    p = _placed(1, 2, 8, ep=8)
    assert p["ep"] == Placement(8, 1, 8, 8) == H100.ep_placement(2, 8)
    assert p["expert_dp"] == Placement(2, 2, 1, 1)


def deepspeeds_expert_groups(pp: int, tp: int, dp: int, ep: int) -> tuple[list, list]:
    """(EP groups, expert-data-parallel groups) as DeepSpeed's MoE layer makes them (``_create_process_groups``
    without expert tensor parallelism -> ``groups._create_expert_and_data_parallel``; ``ensure_expert_groups`` calls
    the same), its process groups recorded instead of made."""
    from unittest import mock

    import deepspeed.utils.groups as G

    made = []
    with mock.patch.object(G.dist, "is_initialized", lambda: True), \
            mock.patch.object(G.dist, "get_world_size", lambda group=None: pp * tp * dp), \
            mock.patch.object(G.dist, "get_rank", lambda group=None: 0), \
            mock.patch.object(G.dist, "new_group", lambda ranks, **kw: made.append(list(ranks))), \
            mock.patch.object(G, "log_dist", lambda *a, **k: None), \
            mock.patch.multiple(G, _EXPERT_PARALLEL_GROUP={}, _EXPERT_DATA_PARALLEL_GROUP={},
                                _EXPERT_PARALLEL_GROUP_RANKS={}, _EXPERT_DATA_PARALLEL_GROUP_RANKS={}):
        G._create_expert_and_data_parallel(ep, pp_size=pp)
    return made[pp * ep:], made[:pp * ep]  # it makes the expert-data-parallel groups first


def test_rank_groups_are_deepspeeds():
    from ds_pipe_ext.parallel.topology import deepspeed_groups

    for pp, tp, dp, ep in ((4, 2, 8, 4), (1, 1, 16, 8), (2, 4, 4, 2), (2, 2, 1, 2), (1, 4, 2, 8)):
        ours = rank_groups(pp, tp, dp, ep)
        for axis, groups in deepspeed_groups(Layout(pp=pp, tp=tp, dp=dp)).items():
            assert sorted(map(sorted, ours[axis])) == sorted(map(sorted, groups))
        ep_groups, edp_groups = deepspeeds_expert_groups(pp, tp, dp, ep)
        assert sorted(map(sorted, ours["ep"])) == sorted(map(sorted, ep_groups))
        assert sorted(map(sorted, ours["expert_dp"])) == sorted(map(sorted, edp_groups))


# -- NCCL's formulas against hand-computed values -------------------------------------------------------------
def _t(kind, nbytes, placement, net=H100, **kw):
    return collective(kind, nbytes, placement, net, **kw)


def test_ring_all_gather_inside_a_dgx_h100():
    c = _t("all-gather", GIB, Placement(8, 1, 8, 8))
    assert (c.algorithm, c.protocol) == ("ring", "Simple")
    # 12 channels x 30 GB/s = 360 GB/s of bus; algorithm bandwidth x 8/7; latency 8.4 + 7 x 3.4 us
    assert c.latency_s == pytest.approx(32.2e-6)
    assert c.time_s == pytest.approx(32.2e-6 + GIB / (360e9 * 8 / 7))


def test_nvls_all_reduce_inside_a_dgx_h100():
    c = _t("all-reduce", GIB, Placement(8, 1, 8, 8))
    assert c.algorithm == "nvls"
    # 8 heads at 40 GB/s (8 x 40 <= 371), x 0.85 x 7/8 x 2 each: 476 GB/s of bus; x 8/14; latency 25 us
    assert c.time_s == pytest.approx(25e-6 + GIB / (8 * 40 * 0.85 * 7 / 8 * 2 * 8 / 14 * 1e9))


def test_nvls_tree_across_eight_dgx_h100_nodes():
    c = _t("all-reduce", GIB, Placement(64, 8, 8, 8))
    assert c.algorithm == "nvls_tree"
    # per channel min(45 x 0.85 x 7/8 x 2, 45, 45.5) = 45, 8 channels; latency 25 + 2 x log2(8) x 20.9 us
    assert c.latency_s == pytest.approx((25 + 2 * 3 * 20.9) * 1e-6)
    assert c.time_s == pytest.approx(c.latency_s + GIB / (8 * 45 * 64 / 126 * 1e9))


def test_ring_all_reduce_one_rank_a_node_pays_the_tree_hop_and_the_plateau():
    c = _t("all-reduce", GIB, Placement(8, 8, 1, 1))
    assert (c.algorithm, c.protocol) == ("ring", "Simple")
    # one rail of 48 GB/s; every step crosses the network at the tree's 14 us (ppn 1); x 1.4 (the ring's plateau)
    assert c.latency_s == pytest.approx((8.4 + 14 * 14.0) * 1.4e-6)
    assert c.time_s == pytest.approx(c.latency_s + GIB / (48e9 * 8 / 14))


def test_pat_all_gather_one_rank_a_node():
    c = _t("all-gather", MIB, Placement(8, 8, 1, 1))
    assert c.algorithm == "pat"
    # 48 GB/s x 0.75, no conversion; latency 8 + log2(8) x 14 / 3.5 + 8 x 2.8 us
    assert c.latency_s == pytest.approx((8 + 3 * 4.0 + 22.4) * 1e-6)
    assert c.time_s == pytest.approx(c.latency_s + MIB / 36e9)


def test_tree_all_reduce_across_two_nodes_ll128():
    c = _t("all-reduce", MIB, Placement(16, 2, 8, 8))
    assert (c.algorithm, c.protocol) == ("tree", "LL128")
    # min(8 x 45 x 0.92, 8 x 41.4) = 331.2, x 120/128 capped at 8 x 36.7; x 0.5; NCCL's correction 0.6 at 1 MiB
    bus = min(min(8 * 45 * 0.92, 8 * 41.4) * 120 / 128, 8 * 36.7)
    assert c.latency_s == pytest.approx((14.0 + 2 * (7 * 1.25 + 1 * 8.5)) * 1e-6)
    assert c.time_s == pytest.approx(c.latency_s + MIB / (bus * 0.5 * 0.6 * 1e9))


def test_dgx_a100_ring_across_two_nodes_amd_hosts():
    c = _t("all-reduce", GIB, Placement(16, 2, 8, 8), net=A100)
    assert (c.algorithm, c.protocol) == ("ring", "Simple")
    # 8 x 24 GB/s; a step inside a node at max(3.4, 3 x 2.0 us of an AMD host's network overhead)
    assert c.latency_s == pytest.approx((8.4 + 28 * 6.0 + 2 * 14.0) * 1.4e-6)
    assert c.time_s == pytest.approx(c.latency_s + GIB / (192e9 * 16 / 30))


def test_nccl_2_8_ring_constants():
    c = _t("all-reduce", GIB, Placement(16, 2, 8, 8), net=A100, version=NCCL_2_8)
    assert c.algorithm == "ring" and c.protocol == "Simple"
    assert c.latency_s == pytest.approx((8.4 + 28 * 3.4 + 2 * 9.6) * 1.9e-6)


def test_all_to_all_leaves_through_the_destinations_rails():
    c = _t("all-to-all", GIB, Placement(16, 2, 8, 8))
    # half of a rank's bytes go to the other node: the node's 8 x 48... 45 GB/s rails carry 8 ranks' halves
    remote = GIB * 8 / 16
    assert c.time_s == pytest.approx(c.latency_s + max(GIB * 7 / 16 / H100.intra_bus_bandwidth(),
                                                         8 * remote / (8 * 48e9) + remote / H100.intra_bus_bandwidth()))


def test_a_group_with_one_rank_a_node_gets_one_rail_and_eight_get_eight():
    one, eight = _t("all-gather", GIB, Placement(8, 8, 1, 1)), _t("all-gather", 8 * GIB, Placement(64, 8, 8, 8))
    assert (one.algorithm, one.bus_bandwidth) == ("ring", pytest.approx(48e9))  # one rail
    assert eight.algorithm == "ring" and eight.bus_bandwidth == pytest.approx(360e9, rel=0.01)  # 8 x 45


# -- every override reaching the collectives, TP's inside the layers too --------------------------------------
def _tp_comm_s(model: PlanModel, lay: Layout) -> float:
    from ds_pipe_ext.costs.estimate import EstimateRequest, estimate_layers

    req = EstimateRequest(micro_batch=lay.micro_batch, seq=model.seq, tp=lay.tp, sp=lay.sp, dtype=model.dtype)
    return sum(row["class_s"]["communication"] for row in estimate_layers(model.cfg, req, model.device))


@pytest.mark.parametrize("override", [dict(intra_node_gbs=10), dict(gpus_per_node=2), dict(fabric="pcie"),
                                      dict(nccl="2.8")])
def test_every_override_reaches_tps_collectives(override):
    cfg = load_model_config("gpt3-1.3b")
    dev = get_device("h100")
    lay = Layout(tp=4, dp=2, micro_batch=1, micro_batches=1)
    base = PlanModel(cfg, dev, plan_cluster(dev), seq=cfg.seq_len, global_batch=2)
    changed = PlanModel(cfg, dev, plan_cluster(dev, **override), seq=cfg.seq_len, global_batch=2)
    assert _tp_comm_s(changed, lay) != pytest.approx(_tp_comm_s(base, lay))
    # the inter-node NIC reaches a TP group that leaves the node
    two = PlanModel(cfg, dev, plan_cluster(dev, gpus_per_node=2), seq=cfg.seq_len, global_batch=2)
    slower = PlanModel(cfg, dev, plan_cluster(dev, gpus_per_node=2, inter_node_gbs=5), seq=cfg.seq_len, global_batch=2)
    assert _tp_comm_s(slower, lay) > _tp_comm_s(two, lay)


def test_the_old_cluster_shorthand_is_one_nic_a_gpu():
    c = Cluster(8, 300e9, 25e9, compute_capability=80)
    assert (c.nics_per_node, c.nic_bandwidth) == (8, 25e9)
    assert math.isclose(c.intra_bus_bandwidth(), 240e9)


# -- how layers run, and whose runtime, on each command -------------------------------------------------------
def _plan_json(capfd, *argv):
    import json

    from ds_pipe_ext.cli import main

    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capfd.readouterr().out)


ONLY = ["--model", "gpt3-1.3b", "--gpus", "16", "--device", "h100", "--global-batch", "32"]


def test_only_takes_the_runtime_and_megatron_implies_its_kernels(capfd):
    from ds_pipe_ext.cli import build_parser
    from ds_pipe_ext.cli.plan import build_model

    only = "pp=2,tp=2,dp=4,mb=1,zero=1"
    deepspeed = _plan_json(capfd, *ONLY, "--only", only)[0]
    megatron = _plan_json(capfd, *ONLY, "--only", only, "--runtime", "megatron")[0]
    assert (deepspeed["runtime"], megatron["runtime"]) == ("deepspeed", "megatron")
    assert megatron["step_s"] != deepspeed["step_s"]
    # --runtime megatron prices Megatron's kernels unless --execution says otherwise; runtime= in --only too
    args = build_parser().parse_args(["plan", *ONLY, "--runtime", "megatron"])
    assert build_model(args)[1].execution == "megatron"
    args = build_parser().parse_args(["plan", *ONLY, "--runtime", "megatron", "--execution", "eager"])
    assert build_model(args)[1].execution == "eager"
    named = _plan_json(capfd, *ONLY, "--only", only + ",runtime=megatron")[0]
    assert named["runtime"] == "megatron" and named["step_s"] == pytest.approx(megatron["step_s"])
    # Megatron's even split, as the published rows ran it
    even = _plan_json(capfd, *ONLY, "--only", only + ",runtime=megatron,split=even")[0]
    assert even["parts"] == [0, 13, 26]


def test_execution_replaces_compile_on_plan_estimate_and_simulate(capfd):
    import json

    from ds_pipe_ext.cli import main

    eager = _plan_json(capfd, *ONLY, "--only", "pp=1,tp=2,dp=8,mb=2,zero=1")[0]
    compiled = _plan_json(capfd, *ONLY, "--only", "pp=1,tp=2,dp=8,mb=2,zero=1", "--execution", "compiled")[0]
    assert compiled["step_s"] < eager["step_s"]
    est = {}
    for execution in ("eager", "megatron"):
        assert main(["estimate", "--model", "gpt3-1.3b", "--device", "h100", "--tp", "2", "--execution", execution,
                     "--json"]) == 0
        est[execution] = json.loads(capfd.readouterr().out)["request"]["execution"]
    assert est == {"eager": "eager", "megatron": "megatron"}
    assert main(["simulate", "--model", "gpt3-1.3b", "--stages", "2", "--device", "h100", "--dtype", "bf16",
                 "--execution", "megatron-2021", "--json"]) == 0
    capfd.readouterr()
    with pytest.raises(SystemExit):
        main(["plan", *ONLY, "--compile"])  # the old flag is gone: one option says how layers run


def test_plan_only_prints_each_collective_with_its_placement(capfd):
    from ds_pipe_ext.cli import main

    assert main(["plan", "--model", "llama3-8b", "--gpus", "64", "--device", "h100", "--global-batch", "256",
                 "--only", "pp=2,tp=2,dp=16,mb=1,zero=1"]) == 0
    out = capfd.readouterr().out
    assert "collectives (DGX H100, NCCL 2.30's model)" in out
    assert "DP all-reduce (a layer's gradients)  16 ranks over 4 nodes, 4 a node" in out
    assert "PP send (a boundary)" in out and "TP all-reduce" in out


def test_the_plan_across_nodes_picks_data_parallel_for_llama3_8b_on_64_h100(capfd):
    rows = _plan_json(capfd, "--model", "llama3-8b", "--gpus", "64", "--device", "h100", "--global-batch", "256",
                      "--top", "3")
    assert rows[0]["pp"] == 1 and rows[0]["schedule"] == "none"  # a layout DeepSpeed runs, because it prices fastest


def test_the_multinode_check_runs_its_published_rows_and_scaling_runs(capsys, monkeypatch):
    """bench/collectives_multinode.py: every published row priced on its system as built, each sharded run's layout
    through plan --only at both node counts (deterministic: the model's own figures)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "collectives_multinode.py"
    spec = importlib.util.spec_from_file_location("collectives_multinode", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = {r["name"]: r for r in map(bench.model_row, bench.load_rows())}
    assert rows["h100-node-allreduce"]["algorithm"] == "nvls/Simple"
    assert rows["a100-hdr-rings"]["model_busbw"] == pytest.approx(192.0)
    assert rows["h20-2-nodes-nvlstree"]["model_latency_us"] == pytest.approx(25 + 2 * 20.9)
    monkeypatch.setattr("sys.argv", [str(path)])  # the bench reads its own flags, not pytest's
    bench.main()
    assert capsys.readouterr().out.splitlines()[-1].startswith("RESULT rows=5 ")


def _calibration_bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "calibrate_at_scale.py"
    spec = importlib.util.spec_from_file_location("calibrate_at_scale", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _predicted_names() -> list[str]:
    import csv
    from pathlib import Path

    with open(Path(__file__).resolve().parents[1] / "bench" / "data" / "published_at_scale.csv") as f:
        return [r["name"] for r in csv.DictReader(f)]


@pytest.mark.parametrize("name", _predicted_names())
def test_a_published_row_is_priced_by_plan_only_as_the_bench_prices_it(name, tmp_path, capfd):
    """No row of bench/calibrate_at_scale.py is priced by a route a user cannot take: its model as a TOML, its
    layout and run settings in --only, its cluster and kernels as options give the bench's step."""
    import json

    from ds_pipe_ext.cli import main
    from ds_pipe_ext.costs.hardware import CALIBRATED

    bench = _calibration_bench()
    r = {row["row"]["name"]: row for row in bench.load_predicted()}[name]
    row, lay, cfg = r["row"], r["layout"], r["cfg"]
    toml = tmp_path / f"{name}.toml"
    toml.write_text("\n".join([f'name = "{name}"', f"vocab_size = {cfg.vocab_size}", f"hidden = {cfg.hidden}",
                               f"layers = {cfg.layers}", f"heads = {cfg.heads}", f"seq_len = {cfg.seq_len}",
                               f"dropout = {cfg.dropout}", f"tie_embeddings = {str(cfg.tie_embeddings).lower()}",
                               'attention = "eager"']) + "\n")
    only = (f"pp={lay.pp},tp={lay.tp},dp={lay.dp},mb={lay.micro_batch},recompute={lay.recompute},"
            f"sp={'on' if lay.sp else 'off'},zero={lay.zero},runtime={lay.runtime},"
            f"overlap={'on' if lay.overlap_comm else 'off'},buckets=deepspeed,"
            f"split={'uniform' if row['split'].startswith('uniform') else 'even'}"
            + (f",lp_grads={row['lp_grads']}" if row["lp_grads"] else "")
            + (f",grad_accum={row['grad_accum_dtype']}" if row["grad_accum_dtype"] else "")
            + (f",schedule={lay.schedule}" if lay.pipelined else "")
            + (",zero3_gather=synchronized" if row["zero3_gather"] else ""))
    assert main(["plan", "--model", str(toml), "--gpus", str(lay.world_size), "--device", row["device"],
                 "--global-batch", str(lay.global_batch), "--dtype", row["dtype"],
                 "--execution", bench.accumulating(row["execution"], lay), "--nccl", row["nccl"] or "2.30",
                 "--seq", str(cfg.seq_len), "--intra-node-gbs", row["intra_gbs"],
                 "--nics-per-node", row["nics_per_node"],
                 "--inter-node-gbs", str(float(row["inter_gbs_per_gpu"]) * 8 / int(row["nics_per_node"])),
                 "--only", only, "--json"]) == 0
    step = json.loads(capfd.readouterr().out)[0]["step_s"]
    gemm = CALIBRATED[row["device"]]["gemm_efficiency"]
    assert step == pytest.approx(bench.predict_row(r, {"gemm_efficiency": gemm}), rel=1e-9)
