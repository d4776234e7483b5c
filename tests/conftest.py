import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# the CPU peak MFU is quoted against is measured once per machine and kept: measured here, with the workers sharing
# the cores, it reads low (an MFU over 100% in the user's next run), so the suite keeps it in the checkout's cache
os.environ.setdefault("DS_PIPE_EXT_CACHE_HOME", str(Path(__file__).resolve().parents[1] / ".ds_pipe_ext_cache"))

import ds_pipe_ext.pipe.schedules  # noqa: E402,F401 - an edge, as train.py and the CLI are: hands in DeepSpeed's order
from ds_pipe_ext.plan.render import MegatronLayoutChecker as _MegatronLayoutChecker  # noqa: E402

def pytest_configure(config):
    config.addinivalue_line("markers", "multiprocess: launches real DeepSpeed processes (slow, tens of seconds)")


@pytest.fixture
def forked_ranks(monkeypatch):
    """The test's launches fork their ranks from its process (``runner.launch`` under ``DS_PIPE_EXT_FORK_RANKS=1``:
    DeepSpeed's launcher's argv and rank environment, each rank a process with its own gloo group, without N + 1
    interpreters importing torch and DeepSpeed: 2 ranks 7.3 -> 2.8 CPU-s a launch, 4 ranks 13.5 -> 5.8 here).
    tests/test_multiprocess.py keeps DeepSpeed's own launcher: the user's command, and the refusals on every rank."""
    from ds_pipe_ext.forked_launch import FORK_ENV

    monkeypatch.setenv(FORK_ENV, "1")


@pytest.fixture
def two_stage_run(tmp_path):
    """An instrumented run directory as a run of SCHEDULE would leave it: two stages over four layers, the
    first twice as slow (forward 4 s + backward 8 s a micro-batch, then 2 + 4 s), four micro-batches,
    no transfers or update.  Worked by hand: GPipe's step is 54 s, 1F1B's 50 s."""
    from ds_pipe_ext.costs.types import LayerCost
    from ds_pipe_ext.instrument.rundir import Predicted, RunDir
    from ds_pipe_ext.layout import Layout

    def make(schedule: str = "1f1b"):
        costs = [LayerCost(f"l{i}", f, 2 * f, activation_bytes=100) for i, f in enumerate((2.0, 2.0, 1.0, 1.0))]
        run = RunDir(tmp_path / schedule)
        run.write_predicted(Predicted(method="parts:0,2,4", parts=[0, 2, 4], micro_batches=4, layer_costs=costs,
                                      layout=Layout(pp=2, micro_batches=4, schedule=schedule).to_dict()))
        zeros = dict.fromkeys(("forward_ms_p90", "backward_ms_p90", "send_activation_ms_mean", "param_bytes",
                               "grad_bytes", "optimizer_bytes", "activation_peak_bytes", "optimizer_step_ms_mean",
                               "reduce_grads_ms_mean", "reduce_tied_grads_ms_mean"), 0.0)
        run.write_summary({"stages": [{**zeros, "stage": s, "forward_ms_mean": f, "backward_ms_mean": 2 * f,
                                       "step_ms_median": 1.0} for s, f in ((0, 4000.0), (1, 2000.0))]})
        return run.path

    return make


class _WorkerLayoutChecker:
    """`plan` checks its Megatron layout string in a child interpreter that imports megatron-core (~4.7 CPU-s,
    ``plan.render.MegatronLayoutChecker``); the suite runs `plan` some 25 times.  One such child a worker
    answers them all: the same check by the same code, its import paid once.  Tests of the checker itself
    build ``plan.render.MegatronLayoutChecker`` directly."""

    child = None

    def __call__(self, *args):
        if self.child is None or self.child.proc.poll() is not None:
            type(self).child = _MegatronLayoutChecker()
        return self.child(*args)

    def close(self) -> None:  # the worker's child outlives each plan
        pass


@pytest.fixture(autouse=True)
def _one_layout_checker_a_worker(monkeypatch):
    monkeypatch.setattr("ds_pipe_ext.plan.render.MegatronLayoutChecker", _WorkerLayoutChecker, raising=True)
    yield


def pytest_sessionfinish(session):
    if _WorkerLayoutChecker.child is not None:
        _WorkerLayoutChecker.child.close()
