"""Partitioning layer costs into pipeline stages.

``partition_min_max`` is the public entry point (``split``).  It takes plain numbers (one time per layer) or
``LayerCost`` records and returns DeepSpeed's ``parts``.  The algorithm itself lives in
:mod:`ds_pipe_ext.partition.algorithms` and needs no torch; the named methods a ds.json chooses among are in
``methods``.
"""

from .algorithms import InfeasibleMemoryCap, PartitionError
from .split import cost_lists, joint_stage_memory, partition_jointly, partition_min_max

__all__ = ["partition_min_max", "partition_jointly", "joint_stage_memory", "PartitionError", "InfeasibleMemoryCap",
           "cost_lists"]
