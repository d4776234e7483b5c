"""ds_pipe_ext.forked_launch: ranks forked from a process as DeepSpeed's one-node launcher starts them (the bench
smoke run's and the launch tests' ranks).  Each case runs in its own interpreter, so that what is checked is
forked_launch alone, not the pytest worker it would otherwise fork."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def in_fresh_process(tmp_path: Path, rank_script: str, *, timeout: float = 30.0) -> dict:
    """forked_launch of 2 ranks of ``rank_script``, from a fresh interpreter; what it returned."""
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(rank_script))
    driver = f"""
        import json, subprocess, sys
        from pathlib import Path
        from ds_pipe_ext.forked_launch import forked_launch
        try:
            p = forked_launch(2, Path({str(script)!r}), ["--flag", "x"], env={{"KEPT": "yes"}}, cwd=Path({str(tmp_path)!r}),
                              port=12345, timeout={timeout})
            print(json.dumps({{"rc": p.returncode, "out": p.stdout, "err": p.stderr}}))
        except subprocess.TimeoutExpired:
            print(json.dumps({{"timeout": True}}))
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(driver)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_each_rank_gets_the_launchers_argv_and_environment(tmp_path):
    got = in_fresh_process(tmp_path, """
        import json, os, sys
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK", "KEPT")
        print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "name": __name__,
                          **{k: os.environ.get(k) for k in keys}}))
        print("to stderr", file=sys.stderr)
    """)
    assert got["rc"] == 0 and got["err"].count("to stderr") == 2
    ranks = sorted((json.loads(line) for line in got["out"].splitlines()), key=lambda r: r["RANK"])
    for rank, r in enumerate(ranks):
        assert r["argv"] == [f"--local_rank={rank}", "--flag", "x"] and r["name"] == "__main__"
        assert (r["RANK"], r["LOCAL_RANK"], r["WORLD_SIZE"], r["LOCAL_SIZE"]) == (str(rank), str(rank), "2", "2")
        assert (r["MASTER_ADDR"], r["MASTER_PORT"], r["CROSS_RANK"], r["KEPT"]) == ("127.0.0.1", "12345", "0", "yes")
        assert r["cwd"] == str(tmp_path)


def test_a_failing_rank_ends_the_others_and_gives_its_exit_code(tmp_path):
    got = in_fresh_process(tmp_path, """
        import os, sys, time
        if os.environ["RANK"] == "1":
            sys.exit("rank 1 gives up")
        time.sleep(60)  # a rank left waiting on the failed one, as in a collective
    """)
    assert got["rc"] == 1 and "rank 1 gives up" in got["err"]


def test_a_launch_past_its_timeout_is_ended(tmp_path):
    got = in_fresh_process(tmp_path, "import time\ntime.sleep(60)\n", timeout=1.0)
    assert got == {"timeout": True}


def test_a_process_holding_a_process_group_is_refused_by_name(tmp_path):
    """Forked ranks would inherit the group: the launch is refused, naming the fix."""
    driver = f"""
        import torch.distributed as dist
        from pathlib import Path
        from ds_pipe_ext.forked_launch import forked_launch
        dist.init_process_group("gloo", init_method="file://{tmp_path / 'init'}", rank=0, world_size=1)
        try:
            forked_launch(2, Path("rank.py"), [], env={{}}, cwd=Path("."), port=12345, timeout=5)
        except RuntimeError as e:
            print(e)
        dist.destroy_process_group()
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(driver)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "holds a torch.distributed process group" in proc.stdout and "DS_PIPE_EXT_FORK_RANKS" in proc.stdout
