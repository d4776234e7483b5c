"""One step's profiler summary (instrument.step_profile): what comes back from a GPU instead of a trace."""

from __future__ import annotations

import json

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ds_pipe_ext.instrument.step_profile import _union_us, summarize, write_summary


def test_the_union_of_kernel_intervals_counts_overlaps_once():
    assert _union_us([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert _union_us([]) == 0


def test_a_cpu_step_summary_names_its_ops_syncs_and_phases(tmp_path):
    x = torch.randn(64, 64, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            loss = (x @ x).relu().sum()
            loss.backward()
            with record_function("ds_pipe_ext.optimizer_step"):
                x.data.add_(x.grad, alpha=-1e-3)
            loss.item()  # a read back: a sync on a GPU
    record = json.loads(write_summary(prof, tmp_path / "s.json", step=3).read_text())
    assert record["step"] == 3 and record["kernels"] == 0 and record["device_busy_ms"] == 0
    assert record["wall_ms"] > 0 and record["device_idle_ms"] == record["wall_ms"]
    assert record["phases"]["optimizer_step"]["calls"] == 2
    assert record["syncs"]["aten::_local_scalar_dense"]["calls"] == 2
    assert "aten::mm" in {op["name"] for op in record["top_host_ops"]}
    assert summarize(prof, top=1)["top_host_ops"][0]["self_ms"] >= record["top_host_ops"][-1]["self_ms"]
