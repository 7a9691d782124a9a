"""The ``mpu`` object ``deepspeed.initialize`` expects, backed by Megatron-Core's parallel_state.

DeepSpeed asks its ``mpu`` for ``get_model_parallel_rank`` / ``get_model_parallel_world_size`` /
``get_model_parallel_group``, which Megatron-Core's ``parallel_state`` does not define; with no
pipeline parallelism the model-parallel group is the tensor-parallel group.
"""

from megatron.core import parallel_state


class MegatronMPU:
    """Answers DeepSpeed's questions about the current Megatron-Core layout."""

    get_tensor_model_parallel_group = staticmethod(parallel_state.get_tensor_model_parallel_group)
    get_tensor_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_tensor_model_parallel_world_size = staticmethod(
        parallel_state.get_tensor_model_parallel_world_size
    )
    get_tensor_model_parallel_src_rank = staticmethod(parallel_state.get_tensor_model_parallel_src_rank)
    get_data_parallel_group = staticmethod(parallel_state.get_data_parallel_group)
    get_data_parallel_rank = staticmethod(parallel_state.get_data_parallel_rank)
    get_data_parallel_world_size = staticmethod(parallel_state.get_data_parallel_world_size)

    @staticmethod
    def get_model_parallel_group():
        assert parallel_state.get_pipeline_model_parallel_world_size() == 1
        return parallel_state.get_tensor_model_parallel_group()

    @staticmethod
    def get_model_parallel_rank():
        return parallel_state.get_tensor_model_parallel_rank()

    @staticmethod
    def get_model_parallel_world_size():
        return parallel_state.get_tensor_model_parallel_world_size()

    @staticmethod
    def get_data_parallel_group_ranks():
        import torch.distributed as dist

        return dist.get_process_group_ranks(parallel_state.get_data_parallel_group())


mpu = MegatronMPU()
