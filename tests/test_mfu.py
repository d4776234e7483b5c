"""Where MFU's CPU peak is kept: the user's cache, unless DS_PIPE_EXT_CACHE_HOME says otherwise; the test suite keeps
its own (a peak measured while the suite's workers share the cores reads low, and would stay in the user's cache)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cache_dir(env: dict) -> str:
    proc = subprocess.run([sys.executable, "-c", "from ds_pipe_ext.mfu import CACHE_DIR; print(CACHE_DIR)"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


def test_the_cpu_peak_is_kept_where_the_environment_says(tmp_path):
    bare = {k: v for k, v in os.environ.items() if k not in ("DS_PIPE_EXT_CACHE_HOME", "XDG_CACHE_HOME")}
    assert cache_dir({**bare, "HOME": str(tmp_path)}) == str(tmp_path / ".cache" / "ds_pipe_ext")
    assert cache_dir({**bare, "XDG_CACHE_HOME": str(tmp_path / "xdg")}) == str(tmp_path / "xdg" / "ds_pipe_ext")
    assert cache_dir({**bare, "DS_PIPE_EXT_CACHE_HOME": str(tmp_path / "mine")}) == str(tmp_path / "mine")


def test_the_suite_keeps_its_cpu_peak_out_of_the_users_cache():
    from ds_pipe_ext import mfu

    if os.environ["DS_PIPE_EXT_CACHE_HOME"] == str(ROOT / ".ds_pipe_ext_cache"):  # conftest's, not the caller's own
        assert mfu.CACHE_DIR == ROOT / ".ds_pipe_ext_cache"
    assert mfu.CACHE_DIR != Path.home() / ".cache" / "ds_pipe_ext"
