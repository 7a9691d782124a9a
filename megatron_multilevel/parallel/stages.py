"""Which pipeline stage holds which parameter, and under which name.

Megatron-Core numbers a stage's layers from 0 (``decoder.layers.0`` on stage 1 is the model's
layer ``offset(1)``); everything this package reads, writes and saves names layers by their
index in the whole model. The first stage holds the embeddings, the last the final norm and the
output layer (and, with tied embeddings, its own copy of the word embedding as
``output_layer.weight``).
"""

import torch

from megatron_multilevel.config import ModelConfig
from megatron_multilevel.config.pipeline import PipelineSplit
from megatron_multilevel.plan import LAYER_PATTERN

TIED_OUTPUT = "output_layer.weight"
WORD_EMBEDDING = "embedding.word_embeddings.weight"


def global_name(name: str, offset: int) -> str:
    """The whole model's name of a stage's parameter ``name`` (its layers start at ``offset``)."""
    m = LAYER_PATTERN.match(name)
    return name if m is None else f"{m.group(1)}.layers.{int(m.group(2)) + offset}.{m.group(3)}"


def stage_offset(cfg: ModelConfig, split: PipelineSplit, stage: int) -> int:
    return split.offsets(cfg.num_layers)[stage]


def copy_stage_from_whole(stage_model: torch.nn.Module, whole: dict, offset: int, tied: bool) -> None:
    """Fill this stage's parameters from the whole model's state ``whole`` (the same tensor-parallel
    layout, every layer): its layers from theirs at ``offset``, a tied output layer's copy from the
    word embedding."""
    with torch.no_grad():
        for name, p in stage_model.named_parameters():
            source = WORD_EMBEDDING if tied and name == TIED_OUTPUT and TIED_OUTPUT not in whole else global_name(
                name, offset)
            assert whole[source].shape == p.shape, (name, source, tuple(whole[source].shape), tuple(p.shape))
            p.copy_(whole[source])
