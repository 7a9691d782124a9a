"""The ``mpu`` object ``deepspeed.initialize`` expects, backed by Megatron-Core's parallel_state.

DeepSpeed asks its ``mpu`` for ``get_model_parallel_rank`` / ``get_model_parallel_world_size`` /
``get_model_parallel_group``, which Megatron-Core's ``parallel_state`` does not define: the
model-parallel group is every rank holding a part of one model replica (its tensor-parallel shards
and, under pipeline parallelism, its stages). The rank in it names a checkpoint's files
(``mp_rank_XX``: stage-major, ``pp_rank * tp_size + tp_rank``); DeepSpeed's gradient norms ask the
tensor-parallel rank, which parameters replicated over the shards count on.
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

    get_pipeline_model_parallel_group = staticmethod(parallel_state.get_pipeline_model_parallel_group)
    get_pipeline_model_parallel_rank = staticmethod(parallel_state.get_pipeline_model_parallel_rank)
    get_pipeline_model_parallel_world_size = staticmethod(parallel_state.get_pipeline_model_parallel_world_size)

    @staticmethod
    def get_model_parallel_group():
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return parallel_state.get_tensor_model_parallel_group()
        return parallel_state.get_model_parallel_group()

    @staticmethod
    def get_model_parallel_rank():
        return (parallel_state.get_pipeline_model_parallel_rank() * parallel_state.get_tensor_model_parallel_world_size()
                + parallel_state.get_tensor_model_parallel_rank())

    @staticmethod
    def get_model_parallel_world_size():
        return (parallel_state.get_tensor_model_parallel_world_size()
                * parallel_state.get_pipeline_model_parallel_world_size())

    @staticmethod
    def get_data_parallel_group_ranks():
        import torch.distributed as dist

        return dist.get_process_group_ranks(parallel_state.get_data_parallel_group())


mpu = MegatronMPU()
