"""ds_pipe_ext: cost-aware pipeline partitioning for DeepSpeed (and Megatron-core TP/SP).

Importing the package is cheap: ``PipelineModule`` and ``DualPipeVPipelineModule`` (which need
DeepSpeed) load on first use.
"""

from ._version import __version__
from .costs.types import LayerCost
from .partition import InfeasibleMemoryCap, PartitionError, partition_min_max

__all__ = ["LayerCost", "partition_min_max", "PartitionError", "InfeasibleMemoryCap", "PipelineModule",
           "DualPipeVPipelineModule", "__version__"]


def __getattr__(name):
    if name in ("PipelineModule", "DualPipeVPipelineModule"):
        from .pipe import module

        return getattr(module, name)
    raise AttributeError(f"module 'ds_pipe_ext' has no attribute {name!r}")
