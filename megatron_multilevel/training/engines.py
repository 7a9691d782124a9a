"""One DeepSpeed engine per level: its DeepSpeed config, batch sizes, layout and optimizer.

The global batch stays the same at every level; when a level changes its tensor-parallel size,
its data-parallel size and micro-batch follow.
"""

import contextlib
from typing import Callable, Optional

import torch

from megatron_multilevel.config import (ModelConfig, RunConfig, is_muon, muon_defaults, muon_parameter,
                                        optimizer_state_keys)
from megatron_multilevel.distributed import default_backend, set_tensor_model_parallel_size
from megatron_multilevel.level_maps import LayerSelection
from megatron_multilevel.models import build_model
from megatron_multilevel.parallel.sequence_parallel import register_sequence_parallel_grad_hooks
from megatron_multilevel.parallel.stages import copy_stage_from_whole
from megatron_multilevel.parallel.staging import Layout
from megatron_multilevel.residual_step import set_residual_step
from megatron_multilevel.training.pipeline import PipelineStep, set_up_pipelined_engine


class LevelEngines:
    """Builds the DeepSpeed config, layout and engine of any level of a run."""

    def __init__(self, cfg: RunConfig, world_size: int):
        self.cfg = cfg
        self.world_size = world_size
        self.models = cfg.level_models()
        self.tp_sizes = cfg.level_tp_sizes()
        self.pipelines = cfg.level_pipelines()
        self.sequence_parallel = cfg.level_sequence_parallel()
        ds = cfg.deepspeed
        self.accumulation = int(ds.get("gradient_accumulation_steps", 1))
        cfg.check_world_size(world_size)
        dp0 = self.data_parallel_size(0)
        if "train_batch_size" in ds:
            self.global_batch = int(ds["train_batch_size"])
        elif "train_micro_batch_size_per_gpu" in ds:
            self.global_batch = int(ds["train_micro_batch_size_per_gpu"]) * self.accumulation * dp0
        else:
            raise ValueError("config: set train_batch_size or train_micro_batch_size_per_gpu")
        for level in range(len(self.tp_sizes)):
            dp = self.data_parallel_size(level)
            if self.global_batch % (self.accumulation * dp):
                raise ValueError(
                    f"level {level}: train_batch_size = {self.global_batch} is not divisible by "
                    f"gradient_accumulation_steps ({self.accumulation}) x data-parallel size ({dp})"
                )

    def micro_batch(self, level: int) -> int:
        return self.global_batch // (self.accumulation * self.data_parallel_size(level))

    def data_parallel_size(self, level: int) -> int:
        return self.world_size // (self.tp_sizes[level] * self.pipelines[level].size)

    def pipelined(self, level: int) -> bool:
        """Whether ``level`` runs over more than one pipeline stage (trained by Megatron-Core's schedule)."""
        return self.pipelines[level].size > 1

    def pipeline_clip(self, level: int) -> float:
        """The gradient-norm clip the pipeline step of ``level`` applies itself (``training/pipeline.py``):
        DeepSpeed's ``gradient_clipping`` at a pipelined level without ZeRO, where DeepSpeed's own clip
        would count the tied embedding twice and other stages' replicated parameters not at all; 0
        elsewhere (ZeRO-1's optimizer clips with the stages' norm)."""
        if not self.pipelined(level) or self.layout(level).zero_stage:
            return 0.0
        return float(self.cfg.level_deepspeed(level).get("gradient_clipping", 0.0))

    def pipeline_step(self, level: int, seq_length: int) -> PipelineStep:
        """The passes of a pipelined ``level`` (Megatron-Core's schedule)."""
        return PipelineStep(self.models[level], seq_length, self.micro_batch(level), self.pipeline_clip(level))

    def optimizer_state_keys(self) -> tuple[str, ...]:
        """The optimizer state a transition can carry: Adam's moments, SGD's momentum (none
        without momentum)."""
        return optimizer_state_keys(self.ds_config(0, 1.0))

    def ds_config(self, level: int, lr_peak: float) -> dict:
        ds = self.cfg.level_deepspeed(level)
        ds["train_batch_size"] = self.global_batch
        ds["train_micro_batch_size_per_gpu"] = self.micro_batch(level)
        ds["gradient_accumulation_steps"] = self.accumulation
        ds.setdefault("optimizer", {"type": "AdamW", "params": {}})
        ds["optimizer"].setdefault("params", {})["lr"] = lr_peak
        ds.setdefault("steps_per_print", 10**9)
        muon_defaults(ds)
        if self.pipelined(level) and not ds.get("zero_optimization", {}).get("stage", 0):
            # clipped by the pipeline step (see pipeline_clip); 0, not absent: DeepSpeed's default is 1
            ds["gradient_clipping"] = 0.0
        return ds

    def layout(self, level: int) -> Layout:
        stage = self.cfg.level_deepspeed(level).get("zero_optimization", {}).get("stage", 0)
        return Layout(self.tp_sizes[level], int(stage), self.pipelines[level])

    def layout_change(self, saved: "LevelEngines") -> Optional[str]:
        """How the layout of the run ``saved`` was written in differs from this one, where its
        checkpoints cannot be loaded here (``None`` where they can): a tensor-parallel size or a
        ZeRO stage changed, or, under ZeRO, the number of data-parallel ranks its partitions follow."""
        for level in range(len(self.tp_sizes)):
            ours, theirs = self.layout(level), saved.layout(level)
            dp_ours, dp_theirs = self.data_parallel_size(level), saved.data_parallel_size(level)
            if ours != theirs or (ours.zero_stage and dp_ours != dp_theirs):
                def say(layout, dp):
                    stages = f", PP={layout.pipeline.size}" * (layout.pipeline.size > 1)
                    return f"TP={layout.tensor_model_parallel_size}{stages}, ZeRO stage {layout.zero_stage}, DP={dp}"
                return f"level {level}: {say(theirs, dp_theirs)} there, {say(ours, dp_ours)} here"
        return None

    def reshard_flags(self) -> str:
        """The options of ``convert_checkpoint.py reshard`` that write a run for this layout."""
        levels = range(len(self.tp_sizes))
        tps, stages = set(self.tp_sizes), {self.layout(level).zero_stage for level in levels}
        pps = {split.size for split in self.pipelines}
        return " ".join([f"--num-gpus {self.world_size}"] + [f"--target-tp {tp}" for tp in tps if len(tps) == 1]
                        + [f"--target-pp {pp}" for pp in pps if len(pps) == 1 and pp > 1]
                        + [f"--zero-stage {stage}" for stage in stages if len(stages) == 1])

    def params_dtype(self, level: int) -> torch.dtype:
        ds = self.ds_config(level, 1.0)
        if ds.get("bf16", {}).get("enabled"):
            return torch.bfloat16
        if ds.get("fp16", {}).get("enabled"):
            return torch.float16
        return torch.float32

    def residual_step(self, level: int) -> float:
        """What the forward pass of ``level``'s model multiplies each layer's residual-branch
        outputs by: depth-muP's branch multiplier (1 without it) times the ODE strategy's coarse
        step in its explicit parametrisation (1 elsewhere)."""
        ml = self.cfg.multilevel
        multiplier = self.models[level].branch_multiplier
        if level == 0 or not ml.enabled or ml.strategy != "ode":
            return multiplier
        return multiplier * LayerSelection(self.models[0], 0, ml.ode.residual_scale, ml.ode.parametrisation).forward_step

    def build_initial_model(self, level: int) -> torch.nn.Module:
        """A freshly initialised model of ``level`` in its layout (partitioned at creation under ZeRO-3)."""
        return set_residual_step(self._build_initial_model(level), self.residual_step(level))

    def _build_initial_model(self, level: int) -> torch.nn.Module:
        pipeline = self.pipelines[level]
        set_tensor_model_parallel_size(self.tp_sizes[level], seed=self.cfg.training.seed,
                                       pipeline_model_parallel_size=pipeline.size)
        cfg, sequence_parallel = self.models[level], self.sequence_parallel[level]
        if pipeline.size > 1 and not torch.cuda.is_available():
            return _with_grad_hooks(self._stage_of_whole_model(level), sequence_parallel)
        if self.layout(level).zero_stage < 3:
            model = build_model(cfg, sequence_parallel=sequence_parallel, pipeline=pipeline)
            return _with_grad_hooks(model, sequence_parallel)
        import deepspeed
        from megatron.core import parallel_state

        from megatron_multilevel.parallel.mpu import mpu

        # zero.Init reads the world through deepspeed.comm, which deepspeed.initialize sets up; before
        # the first engine it would count one rank (and reject the batch sizes of a larger world).
        deepspeed.init_distributed(dist_backend=default_backend())
        with deepspeed.zero.Init(
            data_parallel_group=parallel_state.get_data_parallel_group(),
            config_dict_or_path=self.ds_config(level, 1.0), mpu=mpu,
        ):
            model = build_model(cfg, sequence_parallel=sequence_parallel)
        _reinit_plain_torch_parameters(model, cfg, self.cfg.training.seed)
        return _with_grad_hooks(model, sequence_parallel)

    def _stage_of_whole_model(self, level: int) -> torch.nn.Module:
        """This rank's stage of the model a one-stage run initialises (on the CPU, where every rank
        initialises the whole model and slices it, so that every layout starts from the same weights,
        as every tensor-parallel size does): the whole model is built at one stage, then the stage
        takes its part of it. On a GPU each stage initialises its own layers, as in Megatron-LM."""
        from megatron.core import parallel_state

        tp, pipeline, seed = self.tp_sizes[level], self.pipelines[level], self.cfg.training.seed
        cfg, sequence_parallel = self.models[level], self.sequence_parallel[level]
        set_tensor_model_parallel_size(tp, seed=seed)
        whole = build_model(cfg, sequence_parallel=sequence_parallel).state_dict()
        set_tensor_model_parallel_size(tp, seed=seed, pipeline_model_parallel_size=pipeline.size)
        model = build_model(cfg, perform_initialization=False, sequence_parallel=sequence_parallel, pipeline=pipeline)
        offset = pipeline.offsets(cfg.num_layers)[parallel_state.get_pipeline_model_parallel_rank()]
        copy_stage_from_whole(model, whole, offset, tied=cfg.share_embeddings_and_output_weights)
        return model

    def build_empty_model(self, level: int) -> torch.nn.Module:
        """A model of ``level`` in its layout whose parameters a checkpoint or a transition is about
        to fill (the ``build_target`` of a transition into ``level``)."""
        model = build_empty_model(self.models[level], self.layout(level), self.ds_config(level, 1.0),
                                  sequence_parallel=self.sequence_parallel[level])
        return set_residual_step(model, self.residual_step(level))

    def engine(self, model: torch.nn.Module, level: int, lr_peak: float, lr_factor: Callable[[int], float]):
        """``deepspeed.initialize`` of ``model`` at ``level``, with a fresh AdamW whose learning
        rate follows ``lr_peak * lr_factor(step)``."""
        import deepspeed

        from megatron_multilevel.parallel.mpu import mpu

        config = self.ds_config(level, lr_peak)
        params = config["optimizer"]["params"]
        muon = (params.get("muon_lr", lr_peak), params.get("adam_lr", lr_peak)) if is_muon(config) else None
        groups = parameter_groups(model.named_parameters(), params.get("weight_decay", 0.0), lr_peak,
                                  self.models[level].layer_lr_factor, muon_rates=muon)
        with muon_tags(muon is not None):
            engine, *_ = deepspeed.initialize(
                model=model, model_parameters=groups, config=config, mpu=mpu,
                lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor),
            )
        if self.pipelined(level):
            set_up_pipelined_engine(engine)
        return engine


def parameter_groups(named_parameters, weight_decay: float, lr: float, layer_lr_factor: float = 1.0, *,
                     muon_rates: Optional[tuple[float, float]] = None) -> list[dict]:
    """The optimizer's parameter groups: no weight decay on biases and norms (Megatron's
    convention); with depth-muP (``layer_lr_factor`` not 1) the transformer layers' parameters in
    groups of their own at ``lr * layer_lr_factor``. Empty groups are left out; the order is fixed
    (decayed weights, then biases and norms; the layers' after the rest's), as the checkpoint's
    optimizer state is. With ``muon_rates`` (Muon's and its auxiliary Adam's peak rates: DeepSpeed's
    ``muon_lr`` and ``adam_lr``), each group holds one half (``config.muon_parameter``) at its half's
    rate (times the layers' factor): DeepSpeed gives a group's ``lr`` to both halves of it."""
    halves = (True, False) if muon_rates else (False,)
    groups: dict[tuple[bool, bool, bool], list] = {
        (d, l, m): [] for l in (False, True) for d in (True, False) for m in halves}
    for name, p in named_parameters:
        decayed = not (name.endswith("bias") or "norm" in name)
        in_layer = layer_lr_factor != 1.0 and ".layers." in name
        muon = bool(muon_rates) and muon_parameter(name, getattr(p, "ds_shape", p.shape))
        groups[decayed, in_layer, muon].append(p)
    out = []
    for (decayed, in_layer, muon), params in groups.items():
        rate = lr if muon_rates is None else muon_rates[0 if muon else 1]
        explicit = in_layer or muon_rates is not None
        if params:
            out.append({"params": params, "weight_decay": weight_decay if decayed else 0.0,
                        **({"lr": rate * (layer_lr_factor if in_layer else 1.0)} if explicit else {})})
    return out


@contextlib.contextmanager
def muon_tags(muon: bool):
    """With ``muon``, make ``deepspeed.initialize`` tag ``use_muon`` by ``config.muon_parameter`` (the
    layers' weight matrices; the embeddings, output layer, heads, norms and biases to the auxiliary
    Adam). DeepSpeed tags every parameter itself (``set_optimizer_flags``: any matrix whose name has
    no "embed" or "lm_head", Megatron's ``output_layer`` too) inside ``initialize``, just before it
    builds the optimizer; its tagging runs, then this one."""
    import deepspeed

    if not muon:
        yield
        return
    own = deepspeed.set_optimizer_flags

    def tag(config_class, model):
        own(config_class, model)
        for name, p in model.named_parameters():
            p.use_muon = muon_parameter(name, getattr(p, "ds_shape", p.shape))

    deepspeed.set_optimizer_flags = tag
    try:
        yield
    finally:
        deepspeed.set_optimizer_flags = own


def build_empty_model(cfg: ModelConfig, layout: Layout, ds_config: Optional[dict] = None, *,
                      sequence_parallel: bool = False) -> torch.nn.Module:
    """A model of ``cfg`` in ``layout``, not initialised (its parameters are about to be overwritten),
    partitioned at creation under ZeRO-3 (``ds_config``: the level's DeepSpeed keys), with the
    gradient hooks of sequence parallelism where it runs so. Switches the parallel state to the
    layout's tensor-parallel size."""
    from megatron.core import parallel_state

    pipeline = layout.pipeline
    if (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size()) \
            != (layout.tensor_model_parallel_size, pipeline.size):
        set_tensor_model_parallel_size(layout.tensor_model_parallel_size, pipeline_model_parallel_size=pipeline.size)
    if layout.zero_stage < 3:
        model = build_model(cfg, perform_initialization=False, sequence_parallel=sequence_parallel, pipeline=pipeline)
        return _with_grad_hooks(model, sequence_parallel)
    from megatron_multilevel.parallel.mpu import mpu
    from megatron_multilevel.parallel.zero import partitioned_init

    # Parameters are partitioned as they are created: no rank ever holds the whole model.
    config = dict(ds_config or {})
    config.setdefault("zero_optimization", {})["stage"] = 3
    config.setdefault("train_micro_batch_size_per_gpu", 1)
    with partitioned_init(
        data_parallel_group=parallel_state.get_data_parallel_group(), config_dict_or_path=config, mpu=mpu
    ):
        model = build_model(cfg, perform_initialization=False, sequence_parallel=sequence_parallel)
    return _with_grad_hooks(model, sequence_parallel)


def _with_grad_hooks(model: torch.nn.Module, sequence_parallel: bool) -> torch.nn.Module:
    """``model``, with sequence parallelism's gradient hooks when it runs so (after it is built, as
    torchtitan applies parallelism to a built model)."""
    if sequence_parallel:
        register_sequence_parallel_grad_hooks(model)
    return model


def _reinit_plain_torch_parameters(model: torch.nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Initialise the parameters that Megatron creates as plain torch modules and initialises
    after construction (position and token-type embeddings, BERT's LM-head dense, pooler and
    binary head): under ``deepspeed.zero.Init`` they are already partitioned by then, and keep
    torch's default initialisation (std ~1 instead of ``init_method_std``)."""
    import deepspeed

    prefixes = ("embedding.position_embeddings", "embedding.tokentype_embeddings", "lm_head.dense",
                "pooler.dense", "binary_head")
    targets = [(name, p) for name, p in model.named_parameters() if name.startswith(prefixes)]
    gen = torch.Generator().manual_seed(seed)
    # Data-parallel rank 0's values are broadcast to the other ranks on exit.
    with deepspeed.zero.GatheredParameters([p for _, p in targets], modifier_rank=0), torch.no_grad():
        for name, p in targets:
            if name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * cfg.init_method_std)
