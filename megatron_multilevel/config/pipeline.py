"""Pipeline parallelism of each level: how many stages, and how many layers each stage holds.

A level's stages split its transformer layers in order: stage ``s`` holds a contiguous block of
them, the first stage also the embeddings, the last the final norm and the output layer (as
Megatron-Core's ``pre_process`` / ``post_process`` put them). The split is even unless the
config names the first and/or the last stage's layer count (Megatron-Core's
``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``); the stages in
between then share the rest evenly. Each level has its own split: a coarse level of half depth
may keep the stages (half the layers on each) or use fewer.
"""

from typing import NamedTuple, Optional

from megatron_multilevel.config.parsing import check_positive


class PipelineSplit(NamedTuple):
    """The stages of one level: ``size`` stages, the first and last holding ``first`` and ``last``
    layers where given (else an even share)."""

    size: int = 1
    """Pipeline stages (1: none)."""
    first: Optional[int] = None
    """Layers on the first stage; null: an even share."""
    last: Optional[int] = None
    """Layers on the last stage; null: an even share."""

    def stage_layers(self, num_layers: int, what: str = "parallel") -> list[int]:
        """Layers per stage, first stage first; ``ValueError`` naming the keys where they do not add up."""
        check_positive(f"{what}.pipeline_model_parallel_size", self.size)
        for name, value in (("first", self.first), ("last", self.last)):
            if value is not None and (self.size == 1 or value < 1):
                raise ValueError(f"{what}.num_layers_in_{name}_pipeline_stage = {value}: needs "
                                 f"pipeline_model_parallel_size > 1 and at least one layer (valid: null or >= 1)")
        if self.size == 1:
            return [num_layers]
        fixed = [n for n in (self.first, self.last) if n is not None]
        middle = self.size - len(fixed)
        rest = num_layers - sum(fixed)
        if rest < middle or (middle and rest % middle) or (not middle and rest):
            given = ", ".join(f"{name} stage {n}" for name, n in (("first", self.first), ("last", self.last))
                              if n is not None) or "an even split"
            raise ValueError(
                f"{what}.pipeline_model_parallel_size = {self.size}: {num_layers} layers do not split over "
                f"{self.size} stages with {given} (the other stages must share the rest evenly, at least one "
                f"layer each); set {what}.num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage, "
                f"or a size that divides {num_layers}")
        share = rest // middle if middle else 0
        layers = [share] * self.size
        if self.first is not None:
            layers[0] = self.first
        if self.last is not None:
            layers[-1] = self.last
        return layers

    def stage_of_layer(self, num_layers: int) -> list[int]:
        """The stage of every layer (0-based global index -> stage)."""
        return [s for s, n in enumerate(self.stage_layers(num_layers)) for _ in range(n)]

    def offsets(self, num_layers: int) -> list[int]:
        """The global index of each stage's first layer."""
        out, total = [], 0
        for n in self.stage_layers(num_layers):
            out.append(total)
            total += n
        return out


def level_splits(parallel, ml) -> list[PipelineSplit]:
    """The stages of every level of a run with the ``parallel`` and ``multilevel`` blocks ``parallel``
    and ``ml``: a level's own keys, else the ``parallel`` block's size (and, at level 0, its split)."""
    fine = PipelineSplit(parallel.pipeline_model_parallel_size, parallel.num_layers_in_first_pipeline_stage,
                         parallel.num_layers_in_last_pipeline_stage)
    if not ml.enabled:
        return [fine]
    if ml.strategy == "ode":
        return [fine, PipelineSplit(parallel.pipeline_model_parallel_size)]
    splits = []
    for level, lv in enumerate(ml.levels):
        first, last = (fine.first, fine.last) if level == 0 else (None, None)
        splits.append(PipelineSplit(
            lv.pipeline_model_parallel_size or parallel.pipeline_model_parallel_size,
            first if lv.num_layers_in_first_pipeline_stage is None else lv.num_layers_in_first_pipeline_stage,
            last if lv.num_layers_in_last_pipeline_stage is None else lv.num_layers_in_last_pipeline_stage))
    return splits


# Under pipeline parallelism the backward pass runs in Megatron-Core's schedule, outside
# DeepSpeed's engine: ZeRO stages that partition gradients or parameters during it cannot follow.
PIPELINE_ZERO_STAGES = (0, 1)


def check_pipeline_deepspeed(split: PipelineSplit, deepspeed: dict, level: int) -> None:
    """The DeepSpeed keys a pipelined level cannot run with, refused with one line each."""
    if split.size == 1:
        return
    stage = deepspeed.get("zero_optimization", {}).get("stage", 0)
    if stage not in PIPELINE_ZERO_STAGES:
        raise ValueError(
            f"level {level}: pipeline_model_parallel_size = {split.size} with ZeRO stage {stage}: stages 2 and 3 "
            f"partition gradients (and parameters) inside DeepSpeed's backward pass, and a pipelined level's backward "
            f"runs in Megatron-Core's schedule; valid ZeRO stages with pipeline parallelism are "
            f"{list(PIPELINE_ZERO_STAGES)}")
    if deepspeed.get("fp16", {}).get("enabled"):
        raise ValueError(f"level {level}: pipeline_model_parallel_size = {split.size} with fp16: its dynamic loss "
                         f"scale is DeepSpeed's and the backward pass is Megatron-Core's schedule; use bf16 "
                         f"(valid with pipeline parallelism: bf16 with ZeRO stage 1, or fp32)")
    if deepspeed.get("bf16", {}).get("enabled") and stage != 1:
        raise ValueError(f"level {level}: pipeline_model_parallel_size = {split.size} with bf16 needs ZeRO stage 1 "
                         f"(DeepSpeed's bf16 optimizer without ZeRO reduces gradients inside its own backward "
                         f"pass); set zero_optimization.stage to 1")


def check_pipeline_method(ml, split: PipelineSplit, level: int) -> None:
    """The parts of a multilevel run (``ml``: its ``multilevel`` block) that need a level's whole
    model in one process's forward and backward, refused in one line at a pipelined level."""
    if split.size == 1 or not ml.enabled:
        return
    if ml.strategy == "coalesce" and ml.growth_operator == "ligo":
        raise ValueError(f"multilevel.growth_operator 'ligo' trains its operator through the whole grown model in "
                         f"one pass; level {level} is split over {split.size} pipeline stages (valid there: "
                         f"pipeline_model_parallel_size 1, or another growth_operator)")
    if ml.strategy == "ode" and ml.ode is not None and ml.ode.coherence != "none":
        raise ValueError(f"multilevel.ode.coherence = {ml.ode.coherence!r} takes the coarse model's gradient "
                         f"outside the training step; level {level} is split over {split.size} pipeline stages "
                         f"(valid there: 'none')")
