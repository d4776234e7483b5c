"""ds_pipe_ext: cost-aware pipeline partitioning for DeepSpeed (and Megatron-core TP/SP).

Importing the package is cheap: ``PipelineModule`` (which needs DeepSpeed) loads on first use.
"""

__version__ = "0.1.0"

from .costs.types import LayerCost
from .partition import InfeasibleMemoryCap, PartitionError, partition_min_max

__all__ = ["LayerCost", "partition_min_max", "PartitionError", "InfeasibleMemoryCap", "PipelineModule", "__version__"]


def __getattr__(name):
    if name == "PipelineModule":
        from .pipe.module import PipelineModule

        return PipelineModule
    raise AttributeError(f"module 'ds_pipe_ext' has no attribute {name!r}")
