"""Read a DeepSpeed checkpoint of this project offline (one process, no GPU).

Every ZeRO stage, tensor-parallel and pipeline-parallel size: for each model-parallel rank (a
tensor-parallel shard of one pipeline stage), the fp32 master weights are rebuilt from the ZeRO
partitions with DeepSpeed's own ``zero_to_fp32`` merge routines (which handle one model-parallel
rank at a time) or, without ZeRO, taken from the module states; a tensor-parallel rank's stages are
joined under the whole model's layer names, and the ranks merged with the plan's tensor-parallel layout.

Files are read here, never by ``zero_to_fp32`` (which unpickles with ``weights_only=False``):
``safe_load`` refuses any file that asks for more than tensors and DeepSpeed's own few classes.
"""

import contextlib
import glob
import io
import os
from dataclasses import dataclass

import torch

from megatron_multilevel.training.safe_load import load_checkpoint_file
from megatron_multilevel.config import ModelConfig, RunConfig, load_config
from megatron_multilevel.config.parsing import read_json_object
from megatron_multilevel.config.pipeline import PipelineSplit
from megatron_multilevel.level_maps import LevelMap
from megatron_multilevel.parallel.stages import TIED_OUTPUT, global_name
from megatron_multilevel.parallel.tp_layout import unshard
from megatron_multilevel.plan import is_metadata, parameter_plan
from megatron_multilevel.training.checkpoint import SIDECAR, checkpoint_dir, read_latest
from megatron_multilevel.training.schedule import build_phases


@dataclass
class DeepSpeedCheckpoint:
    """One tag of a run's checkpoints, with what its sidecar says about it."""

    path: str
    tag: str
    sidecar: dict
    config: RunConfig
    level: int
    model: ModelConfig
    tp: int
    zero_stage: int
    pipeline: PipelineSplit = PipelineSplit()

    @property
    def level_maps(self) -> list[LevelMap]:
        return [LevelMap.from_json(text) for text in self.sidecar["level_maps"]]


def open_checkpoint(source: str) -> DeepSpeedCheckpoint:
    """A run directory (its latest checkpoint), its ``checkpoints`` directory, or one tag directory."""
    source = os.path.abspath(source)
    if os.path.isfile(os.path.join(source, SIDECAR)):
        path = source
        sidecar = read_json_object(os.path.join(path, SIDECAR))
        tag = os.path.basename(path)
    else:
        run = os.path.dirname(source) if os.path.basename(source) == "checkpoints" else source
        found = read_latest(run)
        if found is None:
            raise ValueError(f"{source} holds no checkpoint of this project (no {SIDECAR}, no checkpoints/latest)")
        tag, sidecar = found
        path = os.path.join(checkpoint_dir(run), tag)
    config = load_config(sidecar["config"])
    phase = build_phases(config)[sidecar["state"]["phase"]]
    model = config.level_models()[phase.level]
    tp = config.level_tp_sizes()[phase.level]
    stage = _zero_stage(path)
    return DeepSpeedCheckpoint(path, tag, sidecar, config, phase.level, model, tp, stage,
                               config.level_pipelines()[phase.level])


def _zero_stage(path: str) -> int:
    optim = sorted(glob.glob(os.path.join(path, "*_optim_states.pt")))
    if not optim:
        return 0
    state = load_checkpoint_file(optim[0], mmap=True)
    return int(state["optimizer_state_dict"].get("zero_stage", 0))


def rank_state_dicts(ckpt: DeepSpeedCheckpoint) -> list[dict[str, torch.Tensor]]:
    """The fp32 parameters of every tensor-parallel rank (its shards of every stage, under the whole
    model's names; a tied embedding's copy on the last stage left out), in rank order."""
    offsets = ckpt.pipeline.offsets(ckpt.model.num_layers)
    shards = []
    for rank in range(ckpt.tp):
        whole = {}
        for stage, offset in enumerate(offsets):
            sd = _model_parallel_rank(ckpt, stage * ckpt.tp + rank)
            if ckpt.pipeline.size > 1 and ckpt.model.share_embeddings_and_output_weights:
                sd.pop(TIED_OUTPUT, None)
            whole.update({global_name(name, offset): t for name, t in sd.items()})
        shards.append(whole)
    return shards


def _model_parallel_rank(ckpt: DeepSpeedCheckpoint, rank: int) -> dict[str, torch.Tensor]:
    """The fp32 parameters one model-parallel rank (``mp_rank_XX``) saved, under its own names."""
    tag = f"mp_rank_{rank:02d}"
    model_files = sorted(glob.glob(os.path.join(ckpt.path, f"*{tag}_model_states.pt")))
    if not model_files:
        raise ValueError(f"checkpoint {ckpt.path} is missing the shards of model-parallel rank {rank} ({tag}_*: "
                         f"tensor-parallel rank {rank % ckpt.tp}, pipeline stage {rank // ckpt.tp})")
    if ckpt.zero_stage == 0:
        state = load_checkpoint_file(model_files[0])
        return {k: v.detach().float() for k, v in state["module"].items() if not is_metadata(k)}
    return _zero_rank(ckpt, model_files, tag)


def _zero_rank(ckpt: DeepSpeedCheckpoint, model_files: list[str], tag: str) -> dict[str, torch.Tensor]:
    # DeepSpeed's zero_to_fp32 rebuilds one model-parallel rank from its data-parallel partitions;
    # its public entry points only look at mp_rank_00, hence the per-rank calls.
    from deepspeed.utils import zero_to_fp32 as z

    optim_files = sorted(glob.glob(os.path.join(ckpt.path, f"*{tag}_optim_states.pt")), key=z.natural_keys)
    model_states = [_model_state(f) for f in sorted(model_files, key=z.natural_keys)]
    stage, world, groups, paddings = _optim_states(optim_files, ckpt.path, tag)
    os.environ.setdefault("TQDM_DISABLE", "1")
    with contextlib.redirect_stdout(io.StringIO()):  # it narrates every step
        if stage <= 2:
            sd = z._get_fp32_state_dict_from_zero2_checkpoint(world, groups, model_states, False, paddings)
        else:
            sd = z._get_fp32_state_dict_from_zero3_checkpoint(world, groups, model_states, False)
        sd = z.to_torch_tensor(sd)
    return {k: v.detach().float().clone() for k, v in sd.items() if not is_metadata(k)}


def _model_state(file: str):
    """``zero_to_fp32.parse_model_states`` for one file, read with the allowlist."""
    from deepspeed.checkpoint import constants as c
    from deepspeed.utils.zero_to_fp32 import zero_model_state

    sd = load_checkpoint_file(file)
    if c.BUFFER_NAMES not in sd:
        raise ValueError(f"{file} is not a DeepSpeed model state checkpoint")
    buffers = {k: v.float() if v.is_floating_point() else v for k, v in sd["module"].items() if k in sd[c.BUFFER_NAMES]}
    return zero_model_state(
        buffers=buffers, param_shapes=sd[c.PARAM_SHAPES], shared_params=[[k, v] for k, v in sd["shared_params"].items()],
        ds_version=sd.get(c.DS_VERSION), frozen_param_shapes=sd.get(c.FROZEN_PARAM_SHAPES),
        frozen_param_fragments=sd.get(c.FROZEN_PARAM_FRAGMENTS),
    )


def _optim_states(files: list[str], path: str, tag: str) -> tuple:
    """``zero_to_fp32.parse_optim_states``, read with the allowlist: ``(stage, data-parallel size,
    fp32 partitions per rank, alignment paddings)``."""
    from deepspeed.checkpoint import constants as c

    states = []
    for f in files:
        sd = load_checkpoint_file(f, mmap=True)[c.OPTIMIZER_STATE_DICT]
        sd.pop(c.OPTIMIZER_STATE_DICT, None)  # Adam's moments: not needed for the weights
        states.append(sd)
    if not states or c.ZERO_STAGE not in states[0]:
        raise ValueError(f"checkpoint {path}, tensor-parallel rank {tag}: no ZeRO optimizer states")
    stage, world = int(states[0][c.ZERO_STAGE]), states[0][c.PARTITION_COUNT]
    world = max(world) if isinstance(world, list) else world
    if world != len(files):
        raise ValueError(f"checkpoint {path}, tensor-parallel rank {tag}: Expected {world} of "
                         f"'*_optim_states.pt' but found {len(files)} files")
    key = c.SINGLE_PARTITION_OF_FP32_GROUPS if stage <= 2 else c.FP32_FLAT_GROUPS
    return stage, world, [sd[key] for sd in states], states[0].get(c.PARAM_ALIGNMENT_PADDINGS)


def merge_tensor_parallel(shards: list[dict[str, torch.Tensor]], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's shards (the plan says which dim each parameter is split on)."""
    plan = parameter_plan(cfg)
    names = list(shards[0])
    for rank, sd in enumerate(shards[1:], 1):
        if set(sd) != set(names):
            raise ValueError(f"tensor-parallel rank {rank} holds other parameters than rank 0: "
                             f"{sorted(set(sd) ^ set(names))[:6]}")
    return {name: unshard([sd[name] for sd in shards], plan.rule(name)[1]) for name in names}
