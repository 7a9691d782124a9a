"""One DeepSpeed engine per level: its DeepSpeed config, batch sizes, layout and optimizer.

The global batch stays the same at every level; when a level changes its tensor-parallel size,
its data-parallel size and micro-batch follow.
"""

from typing import Callable

import torch

from megatron_multilevel.config import (
    STATE_OPTIMIZERS,
    ModelConfig,
    RunConfig,
    carries_optimizer_state,
    optimizer_state_keys,
)
from megatron_multilevel.parallel.transition import Layout


class LevelEngines:
    """Builds the DeepSpeed config, layout and engine of any level of a run."""

    def __init__(self, cfg: RunConfig, world_size: int):
        from megatron_multilevel.parallel.sequence_parallel import set_sequence_parallel

        self.cfg = cfg
        # Every model built from now on, transitions included, resolves it at its level's TP size.
        set_sequence_parallel(cfg.parallel.sequence_parallel)
        self.world_size = world_size
        self.models = cfg.level_models()
        self.tp_sizes = cfg.level_tp_sizes()
        ds = cfg.deepspeed
        self.accumulation = int(ds.get("gradient_accumulation_steps", 1))
        cfg.check_world_size(world_size)
        dp0 = world_size // self.tp_sizes[0]
        if "train_batch_size" in ds:
            self.global_batch = int(ds["train_batch_size"])
        elif "train_micro_batch_size_per_gpu" in ds:
            self.global_batch = int(ds["train_micro_batch_size_per_gpu"]) * self.accumulation * dp0
        else:
            raise ValueError("config: set train_batch_size or train_micro_batch_size_per_gpu")
        for level, tp in enumerate(self.tp_sizes):
            dp = world_size // tp
            if self.global_batch % (self.accumulation * dp):
                raise ValueError(
                    f"level {level}: train_batch_size = {self.global_batch} is not divisible by "
                    f"gradient_accumulation_steps ({self.accumulation}) x data-parallel size ({dp})"
                )
        if cfg.multilevel.optimizer_state == "map":
            self._check_mapped_state()

    def _check_mapped_state(self) -> None:
        """``optimizer_state = "map"`` carries an optimizer's state through every transition: it
        must be one whose state the transitions know, the same at every level."""
        keys = []
        for level in range(len(self.tp_sizes)):
            ds = self.cfg.level_deepspeed(level)
            kind = ds.get("optimizer", {"type": "AdamW"}).get("type", "")
            if not carries_optimizer_state(kind):
                where = "" if level == 0 else f" at level {level} (multilevel.levels[{level}].deepspeed)"
                raise ValueError(
                    f"multilevel.optimizer_state = 'map' carries Adam's moments or SGD's momentum; "
                    f"optimizer.type is {kind!r}{where}, valid choices are {list(STATE_OPTIMIZERS)}"
                )
            keys.append(optimizer_state_keys(ds))
        if len(set(keys)) > 1:
            states = ", ".join(f"level {i}: {list(k)}" for i, k in enumerate(keys))
            raise ValueError(
                f"multilevel.optimizer_state = 'map' carries one optimizer's state through every level, and "
                f"the levels' optimizers keep different state ({states}); use the same optimizer at every "
                f"level, or optimizer_state 'reset'"
            )

    def micro_batch(self, level: int) -> int:
        return self.global_batch // (self.accumulation * self.data_parallel_size(level))

    def data_parallel_size(self, level: int) -> int:
        return self.world_size // self.tp_sizes[level]

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
        return ds

    def layout(self, level: int) -> Layout:
        stage = self.ds_config(level, 1.0).get("zero_optimization", {}).get("stage", 0)
        return Layout(self.tp_sizes[level], int(stage))

    def params_dtype(self, level: int) -> torch.dtype:
        ds = self.ds_config(level, 1.0)
        if ds.get("bf16", {}).get("enabled"):
            return torch.bfloat16
        if ds.get("fp16", {}).get("enabled"):
            return torch.float16
        return torch.float32

    def build_initial_model(self, level: int) -> torch.nn.Module:
        """A freshly initialised model of ``level`` in its layout (partitioned at creation under ZeRO-3)."""
        from megatron_multilevel.distributed import set_tensor_model_parallel_size
        from megatron_multilevel.models import build_model

        set_tensor_model_parallel_size(self.tp_sizes[level], seed=self.cfg.training.seed)
        cfg = self.models[level]
        if self.layout(level).zero_stage < 3:
            return build_model(cfg)
        import deepspeed
        from megatron.core import parallel_state

        from megatron_multilevel.distributed import default_backend
        from megatron_multilevel.parallel.mpu import mpu

        # zero.Init reads the world through deepspeed.comm, which deepspeed.initialize sets up; before
        # the first engine it would count one rank (and reject the batch sizes of a larger world).
        deepspeed.init_distributed(dist_backend=default_backend())
        with deepspeed.zero.Init(
            data_parallel_group=parallel_state.get_data_parallel_group(),
            config_dict_or_path=self.ds_config(level, 1.0), mpu=mpu,
        ):
            model = build_model(cfg)
        _reinit_plain_torch_parameters(model, cfg, self.cfg.training.seed)
        return model

    def build_empty_model(self, level: int) -> torch.nn.Module:
        """A model of ``level`` in its layout whose parameters a checkpoint is about to fill."""
        from megatron_multilevel.parallel.transition import _build_target

        return _build_target(self.models[level], self.layout(level), self.ds_config(level, 1.0))

    def engine(self, model: torch.nn.Module, level: int, lr_peak: float, lr_factor: Callable[[int], float]):
        """``deepspeed.initialize`` of ``model`` at ``level``, with a fresh AdamW whose learning
        rate follows ``lr_peak * lr_factor(step)``."""
        import deepspeed

        from megatron_multilevel.parallel.mpu import mpu

        config = self.ds_config(level, lr_peak)
        weight_decay = config["optimizer"]["params"].get("weight_decay", 0.0)
        decay, no_decay = [], []
        for name, p in model.named_parameters():
            # No weight decay on biases and norms (Megatron's convention).
            (no_decay if name.endswith("bias") or "norm" in name else decay).append(p)
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=[g for g in groups if g["params"]], config=config, mpu=mpu,
            lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor),
        )
        return engine


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
