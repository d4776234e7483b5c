"""The package installs where GPU users are: Python 3.12 images with their own CUDA torch (NVIDIA's builds are
tagged like pre-releases, ``2.11.0a0+<sha>.nv25.xx``), and the README's commands keep that torch."""

import re
import shlex
import subprocess
import sys
from importlib.metadata import metadata, requires

from packaging.requirements import Requirement

from ds_pipe_ext.runner import ROOT


def installed_requirements() -> dict[str, Requirement]:
    return {r.name: r for r in map(Requirement, requires("ds_pipe_ext")) if r.marker is None}


def test_the_installed_metadata_admits_gpu_images_pythons_and_torches():
    python = metadata("ds_pipe_ext")["Requires-Python"]
    from packaging.specifiers import SpecifierSet

    assert all(v in SpecifierSet(python) for v in ("3.11.7", "3.12.3"))
    assert "3.10.12" not in SpecifierSet(python)
    torch = installed_requirements()["torch"].specifier
    for admitted in ("2.11.0", "2.11.0+cu130", "2.11.0a0+ecf3bae40a.nv25.01", "2.13.0", "2.13.0+cpu"):
        assert torch.contains(admitted) and torch.contains(admitted, prereleases=True), admitted
    assert not torch.contains("2.10.0", prereleases=True) and not torch.contains("2.14.0a0+nv", prereleases=True)
    assert "0.16.1" in installed_requirements()["megatron-core"].specifier


def readme_gpu_install() -> list[str]:
    """The commands of the README's block that installs into a CUDA environment."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    (block,) = [b for b in blocks if "keep-torch" in b]
    return [line for line in block.splitlines() if line.strip()]


def test_the_readmes_gpu_install_keeps_the_installed_torch(tmp_path):
    """Its commands, run here with pip's dry run: the resolver would install this package and nothing else."""
    pin, install = readme_gpu_install()
    assert pin.startswith("python -c") and install.startswith("pip install -c /tmp/keep-torch.txt")
    constraint = tmp_path / "keep-torch.txt"
    pin_cmd = shlex.split(pin.split(">")[0])
    constraint.write_text(subprocess.run([sys.executable, *pin_cmd[1:]], capture_output=True, text=True,
                                         check=True).stdout)
    import torch

    assert constraint.read_text().strip() == f"torch=={torch.__version__}"
    args = shlex.split(install)[2:]
    args[args.index("/tmp/keep-torch.txt")] = str(constraint)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
                           *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (would,) = [line for line in proc.stdout.splitlines() if line.startswith("Would install")]
    assert would.split()[2:] == ["ds_pipe_ext-0.1.0"], would  # torch (or anything else) is not replaced


def test_the_gpu_config_the_readme_starts_from_is_a_valid_run():
    """launch_scripts/ds_gpu_bf16.json: bf16, ZeRO-1, a profiled stage per GPU, for any number of GPUs."""
    from ds_pipe_ext.models import load_model
    from ds_pipe_ext.train.build import run_layout
    from ds_pipe_ext.train.config import build_run_config, read_ds_json

    cfg = build_run_config(read_ds_json(str(ROOT / "launch_scripts" / "ds_gpu_bf16.json")))
    # bf16 without DeepSpeed's per-tensor overflow check, as Megatron runs it (plan prices it so)
    assert cfg.deepspeed["bf16"] == {"enabled": True, "check_grad_overflow": False}
    assert cfg.pipeline.partition_method == "profiled"
    assert cfg.train.compile is True  # each layer torch.compile'd on the GPU
    for gpus in (1, 4, 8):
        layout = run_layout(cfg, load_model(cfg.train.model), gpus)
        assert (layout.pp, layout.dp, layout.zero) == (gpus, 1, 1)
