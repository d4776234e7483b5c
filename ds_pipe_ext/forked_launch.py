"""N ranks of a script forked from this process, as DeepSpeed's one-node launcher would start them.

A launch on the CI machine spends most of its CPU starting interpreters: the launcher's and each rank's
``import torch, deepspeed`` (~2 s of the 2 cores each, ~6 s of a ~9 s tiny launch).  Forked from a process that
has imported them, the ranks start at once.  Everything else is the launch's: every rank runs the script as
``__main__`` with the argv (``--local_rank=R`` first) and the environment (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, LOCAL_SIZE, CROSS_RANK, CROSS_SIZE, and the caller's) that
``deepspeed.launcher.launch`` gives it, in its own process with its own gloo group; the ranks' stdout and stderr
are gathered as the launcher's are; a rank that fails ends the others, as the launcher's signal handler does.

What it does not run is DeepSpeed's launcher itself, and a fresh interpreter's start: the user's command and the
refusals on every rank (tests/test_multiprocess.py) launch through DeepSpeed's.  ``runner.launch`` forks when
``DS_PIPE_EXT_FORK_RANKS=1``: the bench smoke test's ~40 launches, and the other launch tests (conftest's
``forked_ranks``).  Linux only (``os.fork``).  The forking process must hold no process group (refused here: the
ranks would inherit it) and no thread that a rank needs: a pytest-xdist worker's channel thread is copied as
nothing, and the rank, which runs the script alone and leaves by ``os._exit``, takes none of its locks.
"""

from __future__ import annotations

import io
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

FORK_ENV = "DS_PIPE_EXT_FORK_RANKS"


def forking() -> bool:
    """Whether ``runner.launch`` forks its ranks (``DS_PIPE_EXT_FORK_RANKS=1``)."""
    return os.environ.get(FORK_ENV) == "1"


def rank_environment(env: dict, rank: int, num_ranks: int, port: int) -> dict:
    """What ``deepspeed.launcher.launch`` sets for rank ``rank`` of one node (deepspeed/launcher/launch.py)."""
    return {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(num_ranks),
            "CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_SIZE": str(num_ranks), "RANK": str(rank),
            "LOCAL_RANK": str(rank)}


def _exit_code(e: SystemExit) -> int:
    """What the interpreter exits with for ``SystemExit(e.code)`` (a message is printed, then 1)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def fork_script(script: Path, argv: list[str], *, env: dict, cwd: Path, stdout: int, stderr: int,
                new_group: bool = False) -> int:
    """Fork a child that runs ``script`` as ``__main__`` with ``argv``, ``env`` and ``cwd``, its output to the
    file descriptors ``stdout`` and ``stderr``; the child's pid (its exit code is the script's).  ``new_group``:
    the child leads a process group of its own (what it forks joins it), set on both sides of the fork so that
    no child of its can start outside it."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        if new_group:
            os.setpgid(0, 0)
        _run_script(script, argv, env, cwd, stdout, stderr)
    if new_group:
        try:
            os.setpgid(pid, pid)
        except (PermissionError, ProcessLookupError):  # the child has set it already, or has ended
            pass
    return pid


def _run_script(script: Path, argv: list[str], env: dict, cwd: Path, stdout: int, stderr: int) -> None:
    """In the forked child: become the process, run the script, leave without the parent's teardown."""
    code = 1
    try:
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        # unbuffered, as the launcher's `python -u`: a rank that leaves by os._exit keeps what it printed
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.argv = [str(script), *argv]
        sys.path.insert(0, str(script.parent))  # as `python SCRIPT` puts the script's directory first
        import torch

        torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
        runpy.run_path(str(script), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:  # noqa: BLE001 - the rank's failure is its traceback and exit code, as a process's
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def forked_launch(num_ranks: int, script: Path, argv: list[str], *, env: dict, cwd: Path, port: int,
                  timeout: float) -> subprocess.CompletedProcess:
    """Run ``num_ranks`` ranks of ``script`` forked from this process; the launcher's completed process (its
    return code the first failing rank's, else 0; the ranks' stdout and stderr, each gathered in one stream)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        raise RuntimeError("forked_launch: this process holds a torch.distributed process group, which forked ranks "
                           f"would inherit; destroy it first, or unset {FORK_ENV} to launch through DeepSpeed's "
                           "launcher")
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        # appending: the ranks' lines interleave whole, as in the launcher's one pipe
        out_fd = os.open(f"/proc/self/fd/{out.fileno()}", os.O_WRONLY | os.O_APPEND)
        err_fd = os.open(f"/proc/self/fd/{err.fileno()}", os.O_WRONLY | os.O_APPEND)
        pids = []
        try:
            for rank in range(num_ranks):
                pids.append(fork_script(script, [f"--local_rank={rank}", *argv],
                                        env=rank_environment(env, rank, num_ranks, port), cwd=cwd, stdout=out_fd,
                                        stderr=err_fd))
        finally:
            os.close(out_fd)
            os.close(err_fd)
        returncode = wait_all(pids, timeout, " ".join([str(script), *argv]))
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess([str(script), *argv], returncode, out.read().decode(errors="replace"),
                                           err.read().decode(errors="replace"))


def wait_all(pids: list[int], timeout: float, what: str) -> int:
    """Every rank's end; the first non-zero exit ends the others (SIGTERM, then SIGKILL), as the launcher does;
    past ``timeout`` all are killed and ``subprocess.TimeoutExpired`` raised, as ``subprocess.run`` does."""
    deadline, running, returncode = time.monotonic() + timeout, set(pids), 0
    while running:
        ended = False
        for pid in list(running):  # this process's other children are not reaped here
            if pid not in running:  # ended with an earlier rank's failure, in this pass
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done:
                continue
            ended = True
            running.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            if code != 0 and returncode == 0:
                returncode = code
                _end(running, signal.SIGTERM, grace_s=5.0)
        if not ended:
            if time.monotonic() > deadline:
                _end(running, signal.SIGKILL)
                raise subprocess.TimeoutExpired(what, timeout)
            time.sleep(0.02)
    return returncode


def _end(pids: set[int], sig: int, grace_s: float = 0.0) -> None:
    for pid in list(pids):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pids.discard(pid)
    deadline = time.monotonic() + grace_s
    while pids:
        for pid in list(pids):
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                pids.discard(pid)
        if not pids:
            break
        if time.monotonic() > deadline:
            for pid in list(pids):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                os.waitpid(pid, 0)
                pids.discard(pid)
        else:
            time.sleep(0.02)
