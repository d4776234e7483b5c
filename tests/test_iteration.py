"""The iteration model used for calibration at scale: its pieces agree with the simulator and the formulas."""

import pytest

from ds_pipe_ext.costs.hardware import DEVICES
from ds_pipe_ext.costs.iteration import ClusterSpec, predict_iteration
from ds_pipe_ext.layout import Layout
from ds_pipe_ext.models.config import GPTConfig

CFG = GPTConfig(name="t", vocab_size=51200, hidden=4096, layers=32, heads=32, seq_len=2048, dropout=0.1)
A100 = DEVICES["a100-80gb"]


def test_pipeline_bubble_and_interleaving():
    small_vocab = GPTConfig(name="u", vocab_size=128, hidden=4096, layers=32, heads=32, seq_len=2048)  # ~equal stages
    base = dict(tp=8, dp=4, micro_batch=1, micro_batches=16, recompute="full", runtime="megatron")
    flat = predict_iteration(small_vocab, Layout(pp=1, **base), A100, ClusterSpec())
    piped = predict_iteration(small_vocab, Layout(pp=4, **base), A100, ClusterSpec())
    inter = predict_iteration(small_vocab, Layout(pp=4, schedule="interleaved:2", **base), A100, ClusterSpec())
    m = 64 // 4
    assert flat.bubble_fraction == pytest.approx(0.0, abs=1e-12)
    assert piped.bubble_fraction == pytest.approx(3 / (m + 3), rel=0.05)  # 1F1B: (p - 1) / (m + p - 1)
    # v = 2 halves the fill and drain (its extra p2p crossings add a little)
    assert inter.bubble_fraction == pytest.approx(1.5 / (m + 1.5), rel=0.1)


def test_recompute_costs_time_and_overlap_hides_gradient_reduction():
    kw = dict(tp=1, pp=1, dp=64, micro_batch=4, micro_batches=2, runtime="megatron")
    none = predict_iteration(CFG, Layout(recompute="none", **kw), A100, ClusterSpec())
    full = predict_iteration(CFG, Layout(recompute="full", **kw), A100, ClusterSpec())
    assert full.pipeline_s / none.pipeline_s == pytest.approx(4 / 3, rel=0.1)  # one more forward of three
    hidden = predict_iteration(CFG, Layout(recompute="none", overlap_comm=True, **kw), A100, ClusterSpec())
    assert none.dp_comm_s > 0 and hidden.dp_comm_s < none.dp_comm_s
    with pytest.raises(ValueError, match="do not split"):
        predict_iteration(CFG, Layout(tp=1, pp=3, dp=1, micro_batch=1, micro_batches=8), A100, ClusterSpec())
