"""Run `deepspeed --num_gpus N train.py ...`, or what it runs on one node, for real; collect what each rank wrote.

Used by the multi-process tests and the benches; needs a source checkout (train.py).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository: train.py, launch_scripts/


# every bench's --smoke: make test runs each bench so (tests/test_bench_smoke.py), so that a refactor that breaks
# a bench's imports or code path fails the suite rather than the next person who runs it
SMOKE_HELP = ("run the whole code path at its smallest size, its launches included, and print the RESULT line: "
              "a check that the bench runs (make test), not a measurement")


def write_config(path: Path, base: str = "ds_pipeline.json", **overrides) -> Path:
    """A copy of launch_scripts/BASE with top-level sections replaced or merged (None removes one)."""
    cfg = json.loads((ROOT / "launch_scripts" / base).read_text())
    for key, value in overrides.items():
        if value is None:
            cfg.pop(key, None)
        elif isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))
    return path


def _ephemeral_ports() -> range:
    """The range the kernel hands out for bind(0) and outgoing connections (Linux's ip_local_port_range)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


def free_port() -> int:
    """A free TCP port on loopback, below the ephemeral range.  A port from bind(0) is ephemeral: between this
    check and the rendezvous store's bind (seconds of imports later) any gloo pair or outgoing connection of a
    concurrent launch may be handed it, and the launch fails with EADDRINUSE.  Below the range only another
    explicit bind can take it.  Never DeepSpeed's default 29500, which another job may hold."""
    ephemeral = _ephemeral_ports()
    candidates = [p for p in range(20000, min(ephemeral.start, 30000)) if p != 29500]
    rng = random.SystemRandom()
    for port in rng.sample(candidates, min(64, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # a machine whose range starts low
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def deepspeed_launcher() -> Path:
    """DeepSpeed's ``deepspeed`` script: beside this Python (a venv's), else the first on PATH (a system
    Python's pip puts scripts in /usr/local/bin while ``python3`` is /usr/bin/python3)."""
    beside = Path(sys.executable).with_name("deepspeed")
    if beside.exists():
        return beside
    found = shutil.which("deepspeed")
    if found is None:
        raise SystemExit(f"no `deepspeed` launcher beside {sys.executable} or on PATH: install DeepSpeed into "
                         f"this Python (pip install deepspeed; docs/GPU.md without a registry)")
    return Path(found)


def single_node_launch(num_ranks: int, port: int) -> list[str]:
    """What ``deepspeed --num_gpus N --master_port PORT`` runs without a hostfile (deepspeed/launcher/runner.py,
    its one-node branch): deepspeed.launcher.launch with the slots 0..N-1 of localhost, encoded by the runner's
    own ``encode_world_info``."""
    from deepspeed.launcher.runner import encode_world_info

    world_info = encode_world_info({"localhost": list(range(num_ranks))})
    return [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info}",
            "--master_addr=127.0.0.1", f"--master_port={port}", "--enable_each_rank_log=None", "--log_level=info"]


def launch(num_ranks: int, config: Path | None, *args: str, out_dir: Path | None = None, cwd: Path = ROOT,
           timeout: int = 240, threads_per_rank: int = 1, script: str = "train.py", env: dict | None = None,
           user_command: bool = False, root: Path = ROOT):
    """N ranks of SCRIPT on this machine, spawned by DeepSpeed's launcher on a free port: the one launcher of the
    tests and benches.  Returns (completed process, {rank: metrics}).  Ranks run with
    OMP_NUM_THREADS=threads_per_rank.

    ``user_command=True`` runs the user's own ``deepspeed --num_gpus N SCRIPT ...``.  Otherwise the command that
    ``deepspeed`` itself runs on one node (``single_node_launch``): the same per-node launcher, the same rank
    environment, without the runner's own interpreter (~3 s of imports a launch).

    ``script`` (relative to the repository) gets ``--metrics-out OUT_DIR/metrics.json`` where ``out_dir``
    is given, and must then write NAME.rankR.json files; without ``out_dir`` it reports its own way.
    ``config`` is passed as ``--deepspeed_config`` unless None.  ``root``: the checkout whose SCRIPT runs, on the
    ranks' PYTHONPATH (bench/throughput_ab.py runs an older one).

    Under ``DS_PIPE_EXT_FORK_RANKS=1`` the ranks are forked from this process (``forked_launch``: the same argv
    and rank environment, without the interpreters' start-up), unless ``user_command``.
    """
    from ds_pipe_ext.forked_launch import forked_launch, forking

    config_args = ["--deepspeed_config", str(config)] if config is not None else []
    metrics_args = ["--metrics-out", str(out_dir / "metrics.json")] if out_dir is not None else []
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank), "PYTHONPATH": str(root),
           "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", **(env or {})}
    if forking() and not user_command and Path(root).resolve() == ROOT:  # forked ranks hold this checkout's modules
        proc = forked_launch(num_ranks, ROOT / script, [*config_args, *metrics_args, *args], env=env, cwd=Path(cwd),
                             port=port, timeout=timeout)
    else:
        launcher = ([str(deepspeed_launcher()), "--num_gpus", str(num_ranks), "--master_port", str(port)]
                    if user_command else single_node_launch(num_ranks, port))
        cmd = [*launcher, str(Path(root) / script), *config_args, *metrics_args, *args]
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    ranks = {}
    for f in (out_dir.glob("metrics.rank*.json") if out_dir is not None else ()):
        d = json.loads(f.read_text())
        ranks[d["rank"]] = d
    return proc, ranks


def measure_in_one_launch(out_dir: Path, methods: list[str], *, train: dict, micro_batch: int, micro_batches: int,
                          step_model: Path, label: str | None = None, env: dict | None = None,
                          warm_build: bool = True) -> list[dict]:
    """Measure partition ``methods`` one after another in one 2-rank launch of bench/splits_in_one_launch.py
    (2 stages, a fresh profile per `profiled` build, ``step_model`` for its decision); its records in order.

    Resumable: a launch whose metrics.json exists in ``out_dir`` is read, not run again, provided it
    measured the same methods with the same micro-batching and ``train`` section (else SystemExit:
    a stale directory never passes for this run).  ``train`` is the ds.json ``train`` section (model,
    steps, seed, ...); ``env`` goes to the ranks' environment.  ``warm_build=False``: no unrecorded build
    first (a launch of one build, measured as a user's own launch runs it).
    """
    out_dir = Path(out_dir)
    done = out_dir / "metrics.json"
    label = label or out_dir.name
    wanted = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": micro_batches,
              "train": train}
    if done.is_file():
        measured = json.loads(done.read_text())["measured"]
        check_resumed(out_dir, label, [r["method"] for r in measured], methods, wanted)
        return measured
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = write_config(out_dir / "ds.json", **wanted,
                       pipeline={"stages": 2, "step_model": str(step_model),
                                 "profile": {"warmup": 2, "repeats": 5, "cache_dir": None, "progress": False}})
    t0 = time.perf_counter()
    extra = [] if warm_build else ["--no-warm-build"]
    proc, ranks = launch(2, cfg, "--methods", ";".join(methods), *extra, out_dir=out_dir, cwd=out_dir, timeout=3600,
                         script="bench/splits_in_one_launch.py", env=env)
    if proc.returncode != 0 or 0 not in ranks:
        raise SystemExit(f"{label}: launch failed\n{proc.stderr[-3000:]}")
    print(f"  {label}: {len(methods)} builds in one launch ({time.perf_counter() - t0:.0f} s)", flush=True)
    return json.loads(done.read_text())["measured"]


def check_resumed(out_dir: Path, label: str, stored_methods: list[str], methods: list[str], wanted: dict) -> None:
    """Refuse a stored launch that measured something else than this call asks for."""
    problems = [] if stored_methods == list(methods) else [f"methods {stored_methods} (asked {list(methods)})"]
    config = out_dir / "ds.json"
    if config.is_file():
        cfg = json.loads(config.read_text())
        for key, value in wanted.items():  # a dict section was merged into the base config's: compare its keys
            have = ({k: cfg.get(key, {}).get(k) for k in value} if isinstance(value, dict)
                    else cfg.get(key))
            if have != value:
                problems.append(f"{key} {have!r} (asked {value!r})")
    if problems:
        raise SystemExit(f"{label}: {out_dir} holds a launch that measured {'; '.join(problems)}; "
                         "remove the directory or choose another --out")
