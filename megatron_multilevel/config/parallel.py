"""The ``parallel`` block: tensor and pipeline parallelism, and where Megatron's sequence parallelism runs."""

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_multilevel.compat import sequence_parallel_supported
from megatron_multilevel.config.parsing import check_positive


@dataclass
class ParallelConfig:
    """Model-parallel layout (data parallelism fills the remaining ranks)."""

    tensor_model_parallel_size: int = 1
    """Megatron tensor-parallel size."""
    sequence_parallel: Optional[bool] = None
    """Megatron's sequence parallelism at every level whose TP size is above 1 (the activations
    outside the tensor-parallel regions split along the sequence: their memory falls by the TP
    size): null turns it on where CUDA is available, true wherever TP > 1, false nowhere."""

    pipeline_model_parallel_size: int = 1
    """Megatron-Core pipeline-parallel size (stages) of every level that does not set its own
    (``multilevel.levels[*].pipeline_model_parallel_size``)."""
    num_layers_in_first_pipeline_stage: Optional[int] = None
    """Layers on the first stage of the full model (level 0) where the split is uneven; null: an even share."""
    num_layers_in_last_pipeline_stage: Optional[int] = None
    """Layers on the last stage of the full model (level 0) where the split is uneven; null: an even share."""

    def __post_init__(self):
        check_positive("parallel.tensor_model_parallel_size", self.tensor_model_parallel_size)
        check_positive("parallel.pipeline_model_parallel_size", self.pipeline_model_parallel_size)


def resolve_sequence_parallel(setting: Optional[bool], tensor_model_parallel_size: int, kind: str) -> bool:
    """Whether a level of ``kind`` ("gpt", "bert") at this TP size runs sequence-parallel under
    ``parallel.sequence_parallel = setting``.

    Off at TP 1 (Megatron needs TP > 1); ``None`` (auto) turns it on where CUDA is available
    and the model supports it; ``True`` turns it on at every TP > 1."""
    if setting is False or tensor_model_parallel_size == 1:
        return False
    if setting is None:
        return torch.cuda.is_available() and sequence_parallel_supported(kind)
    return True


def check_sequence_parallel_supported(kind: str) -> None:
    """Raise a ValueError if a model of ``kind`` cannot run sequence-parallel here."""
    if not sequence_parallel_supported(kind):
        raise ValueError(
            f"parallel.sequence_parallel = true: Megatron-Core's BERT LM head needs Apex's fused "
            f"norm for sequence parallelism (its torch norm rejects it), and Apex is not installed "
            f"here (as on every CPU machine); valid choices for model.kind = {kind!r} here are "
            f"[null, false]"
        )
