"""megatron-core's parallel groups in the shape DeepSpeed's engine asks for (``deepspeed.initialize(mpu=...)``).

DeepSpeed reads tensor/data-parallel groups from an ``mpu`` object with the
``get_model_parallel_*`` / ``get_data_parallel_*`` methods of Megatron-LM's old
``mpu`` module; megatron-core names them ``get_tensor_model_parallel_*``.  With it,
a data-parallel engine (no pipeline) reduces gradients over the data-parallel group
only, so TP x DP runs without a PipelineModule.
"""

from __future__ import annotations


class MegatronMPU:
    def __init__(self):
        from megatron.core import parallel_state

        self._ps = parallel_state

    def get_model_parallel_rank(self) -> int:
        return self._ps.get_tensor_model_parallel_rank()

    def get_model_parallel_world_size(self) -> int:
        return self._ps.get_tensor_model_parallel_world_size()

    def get_model_parallel_group(self):
        return self._ps.get_tensor_model_parallel_group()

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._ps.get_tensor_model_parallel_src_rank()

    def get_data_parallel_rank(self) -> int:
        return self._ps.get_data_parallel_rank()

    def get_data_parallel_world_size(self) -> int:
        return self._ps.get_data_parallel_world_size()

    def get_data_parallel_group(self):
        return self._ps.get_data_parallel_group()
