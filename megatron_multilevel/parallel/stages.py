"""Which pipeline stage holds which parameter, and under which name.

Megatron-Core numbers a stage's layers from 0 (``decoder.layers.0`` on stage 1 is the model's
layer ``offset(1)``); everything this package reads, writes and saves names layers by their
index in the whole model. The first stage holds the embeddings, the last the final norm and the
output layer (and, with tied embeddings, its own copy of the word embedding as
``output_layer.weight``).
"""

import re

import torch
import torch.distributed as dist

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


def layer_offset(module: torch.nn.Module) -> int:
    """The whole model's index of this stage's first layer (Megatron-Core numbers its layers from 1
    over the whole model: ``layer_number``)."""
    for name, sub in module.named_modules():
        m = re.match(r"^(?:.*\.)?(decoder|encoder)\.layers\.(\d+)$", name)
        if m and hasattr(sub, "layer_number"):
            return sub.layer_number - 1 - int(m.group(2))
    return 0


class StageTable:
    """Which pipeline stage holds each parameter (by its whole-model name), and the shape and dtype
    that a reader returns for it, agreed by every stage of this rank's pipeline (one exchange when
    a stream is made). A read is done by the owning stage and broadcast over the pipeline group, so
    that every stage sees every tensor, as every rank does without pipeline parallelism."""

    def __init__(self, pp_group, pp_rank: int, entries: dict[str, tuple[tuple, torch.dtype]]):
        every: list = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(every, [(name, tuple(shape), str(dtype)) for name, (shape, dtype) in entries.items()],
                               group=pp_group)
        self.pp_group, self.pp_rank = pp_group, pp_rank
        self.owner: dict[str, int] = {}
        self.shapes: dict[str, tuple[tuple, torch.dtype]] = {}
        for stage, listed in enumerate(every):
            for name, shape, dtype in listed:
                if name not in self.owner:
                    self.owner[name] = stage
                    self.shapes[name] = (shape, getattr(torch, dtype.removeprefix("torch.")))
        self.names = list(self.owner)

    def is_mine(self, name: str) -> bool:
        return self.owner[name] == self.pp_rank

    def broadcast(self, name: str, value: "torch.Tensor | None", rows: "tuple[int, int] | None",
                  device: torch.device) -> torch.Tensor:
        """The owner's ``value`` of ``name`` (or its rows ``[start, stop)``) on every stage."""
        if self.is_mine(name):
            value = value.contiguous()
        else:
            shape, dtype = self.shapes[name]
            if rows is not None:
                shape = (rows[1] - rows[0], *shape[1:])
            value = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(value, group=self.pp_group, group_src=self.owner[name])
        return value
