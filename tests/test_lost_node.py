"""A job that loses a node resumes on the node it has left.

Two launches of DeepSpeed's own launcher, ``deepspeed --no_ssh --node_rank N --num_nodes 2`` over a hostfile,
make 2 nodes of 2 CPU ranks: a pipeline of 2 stages x dp 2 under ZeRO-1 (the GPU config README ships).  It saves
step 2; during the save of step 4 node 1 stops, and the test kills its launch, then node 0's (whose ranks would
wait in gloo until the process-group timeout), as a cluster's scheduler ends a job that lost a node.  Node 0
alone, 2 ranks, resumes from step 2 at the same global batch (dp 1, twice the accumulation), the split re-run
for the ranks it has.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from ds_pipe_ext.forked_launch import FORK_ENV
from ds_pipe_ext.runner import ROOT, deepspeed_launcher, free_port, launch, write_config
from test_trainer import step_losses

pytestmark = pytest.mark.multiprocess


def start_node(node: int, hostfile, port: int, ds, ckpt, log, env: dict) -> subprocess.Popen:
    cmd = [str(deepspeed_launcher()), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node),
           "--num_nodes", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
           str(ROOT / "train.py"), "--deepspeed_config", str(ds), "--save", str(ckpt)]
    return subprocess.Popen(cmd, cwd=log.parent, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # its own process group: killed whole, as a node is lost


def test_a_job_that_loses_a_node_resumes_on_the_node_left(tmp_path, monkeypatch):
    ds = write_config(tmp_path / "ds.json", zero_optimization={"stage": 1}, train_micro_batch_size_per_gpu=2,
                      gradient_accumulation_steps=2, pipeline={"stages": 2, "partition_method": "profiled"},
                      train={"model": "tiny", "steps": 4, "seed": 1234, "save_interval": 2})
    hostfile, ckpt = tmp_path / "hostfile", tmp_path / "ckpt"
    hostfile.write_text("node0 slots=2\nnode1 slots=2\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "DS_PIPE_EXT_FAULT_SAVE": "2:0:4:hang",
           "PATH": f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}"}
    port, logs = free_port(), [tmp_path / "node0.log", tmp_path / "node1.log"]
    nodes = [start_node(n, hostfile, port, ds, ckpt, logs[n], env) for n in (0, 1)]
    try:
        deadline = time.time() + 150
        while "rank hangs during the save" not in logs[1].read_text():
            assert time.time() < deadline and all(n.poll() is None for n in nodes), \
                (logs[0].read_text()[-3000:], logs[1].read_text()[-3000:])
            time.sleep(0.2)
    finally:
        for node in (nodes[1], nodes[0]):  # the lost node, then the job's other node, as a scheduler does
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()
    whole = step_losses(logs[0].read_text())
    assert sorted(whole) == [1, 2, 3, 4]  # node 0's rank 0 logged every step before the save of step 4
    assert (ckpt / "latest").read_text() == "global_step2"  # step 4's save was never committed

    out = tmp_path / "resumed"
    out.mkdir()
    monkeypatch.setenv(FORK_ENV, "1")  # node 0's two ranks forked from this process: the check is the resume
    left = write_config(tmp_path / "left.json", base=str(ds), gradient_accumulation_steps=4)  # dp 1 x 4 x 2 = 8
    proc, ranks = launch(2, left, "--load", str(ckpt), "--steps", "2", out_dir=out, cwd=tmp_path,
                         env={"DS_PIPE_EXT_FAULT_SAVE": ""}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ranks[0]["start_step"] == 2 and ranks[0]["dp"] == 1
    assert "resumed on pp 2 x tp 1 x dp 1, zero 1, split" in proc.stdout
    assert "by partition_method 'profiled' for the ranks this run has" in proc.stdout
    assert "the global batch stays 8 samples" in proc.stdout
    print(f"lost node: step 3 {whole[3]!r} -> resumed {ranks[0]['losses'][0]!r} "
          f"(rel {abs(ranks[0]['losses'][0] / whole[3] - 1):.2e}); step 4 {whole[4]!r} -> {ranks[0]['losses'][1]!r}")
    assert ranks[0]["losses"][0] == pytest.approx(whole[3], rel=1e-5)  # the first step after the checkpoint
    assert ranks[0]["losses"][1] == pytest.approx(whole[4], rel=1e-4)
