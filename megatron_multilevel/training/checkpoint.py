"""Checkpoints: DeepSpeed's own (every ZeRO format) plus a small JSON sidecar.

``<run>/checkpoints/<tag>/`` holds what ``engine.save_checkpoint`` writes, one
``rng_rank<r>.pt`` per rank and ``multilevel.json``: the position in the cycle (phase, step,
global step), the level maps, where each coalesced level's pre-coalescing model is kept (the tag
of its checkpoint), counters and the finished phases. ``<run>/checkpoints/latest`` names the last
complete checkpoint and is replaced atomically after everything else is on disk, so a run killed
at any moment resumes from a complete checkpoint.
"""

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

SIDECAR = "multilevel.json"
POINTER = "latest"
FORMAT_VERSION = 1


@dataclass
class RunState:
    """Where a run is, and what it has counted so far."""

    phase: int = 0
    step: int = 0
    """Steps completed in ``phase``."""
    global_step: int = 0
    """Steps completed in the whole run (the position in the data)."""
    open_levels: dict = field(default_factory=dict)
    """Coalesced levels not yet rebuilt: level -> tag of its checkpoint just before coalescing
    (one per level: every cycle rebuilds a level before coalescing it again)."""
    counters: dict = field(default_factory=lambda: {
        "tokens": 0, "flops": 0.0, "train_seconds": 0.0, "transition_seconds": 0.0,
        "eval_seconds": 0.0, "checkpoint_seconds": 0.0,
    })
    phases: list = field(default_factory=list)
    """One summary row per finished phase."""
    log_window: list = field(default_factory=list)
    """Training losses since the last logged step (a resumed run logs the same means)."""
    ode: dict = field(default_factory=dict)
    """ODE strategy: values of the open coarse phase a resume needs (the line search's
    ``reference_loss``)."""


def crash_point(where: str) -> None:
    """Fault injection for the crash-safety tests: ``MEGATRON_MULTILEVEL_CRASH_AT=<where>`` ends
    the process right there with no cleanup at all, as a SIGKILL would."""
    if os.environ.get("MEGATRON_MULTILEVEL_CRASH_AT") == where:
        os._exit(137)


def tag_of(phase: int, step: int) -> str:
    return f"phase{phase:02d}-step{step:07d}"


def phase_of(tag: str) -> int:
    """The phase of a tag made by ``tag_of``."""
    match = re.fullmatch(r"phase(\d+)-step\d+", tag)
    assert match, f"not a checkpoint tag: {tag!r}"
    return int(match.group(1))


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {"torch": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(engine, run_dir: str, state: RunState, *, meta: dict,
         extra: Optional[Callable[[str], None]] = None) -> str:
    """Save a checkpoint of ``engine`` at ``state`` (collective); returns its tag. ``extra(directory)``
    writes more files into the checkpoint before it is marked complete."""
    ckpt = checkpoint_dir(run_dir)
    tag = tag_of(state.phase, state.step)
    rank = dist.get_rank()
    if rank == 0 and os.path.isdir(os.path.join(ckpt, tag)):
        shutil.rmtree(os.path.join(ckpt, tag))  # leftovers of a save that was killed
    dist.barrier()
    engine.save_checkpoint(ckpt, tag=tag, save_latest=False)
    crash_point(f"save:{tag}")  # DeepSpeed's files written, ours not yet, the checkpoint not marked complete
    torch.save(_rng_state(), os.path.join(ckpt, tag, f"rng_rank{rank}.pt"))
    if extra is not None:
        extra(os.path.join(ckpt, tag))
    dist.barrier()
    if rank == 0:
        sidecar = {"format": FORMAT_VERSION, "tag": tag, "world_size": dist.get_world_size(), **meta,
                   "state": asdict(state)}
        _atomic_write(os.path.join(ckpt, tag, SIDECAR), json.dumps(sidecar, indent=1))
        _atomic_write(os.path.join(ckpt, POINTER), tag)
    dist.barrier()
    return tag


def read_latest(run_dir: str) -> Optional[tuple[str, dict]]:
    """``(tag, sidecar)`` of the last complete checkpoint, or None for a fresh run."""
    ckpt = checkpoint_dir(run_dir)
    pointer = os.path.join(ckpt, POINTER)
    if not os.path.exists(pointer):
        return None
    with open(pointer) as f:
        tag = f.read().strip()
    path = os.path.join(ckpt, tag, SIDECAR)
    try:
        with open(path) as f:
            sidecar = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"checkpoint {path} is unreadable ({e}); remove {pointer} to start afresh") from None
    if sidecar.get("format") != FORMAT_VERSION:
        raise ValueError(f"checkpoint {path} has an unsupported format {sidecar.get('format')!r}")
    return tag, sidecar


def state_of(sidecar: dict) -> RunState:
    state = RunState(**sidecar["state"])
    state.open_levels = {int(k): v for k, v in state.open_levels.items()}
    return state


def load(engine, run_dir: str, tag: str, *, module_only: bool = False, restore_rng: bool = True) -> None:
    """Load checkpoint ``tag`` into ``engine`` (collective).

    Trusted files only: DeepSpeed's ``load_checkpoint`` and the RNG states below unpickle with
    ``weights_only=False``, which can run code a file names. A run resumes from the checkpoints it
    wrote itself, or that ``tools/convert_checkpoint.py reshard`` / ``init-run`` wrote after reading
    their source with the allowlist of ``checkpoints.safe_load``; a checkpoint from elsewhere goes
    through those tools, never straight to a run."""
    ckpt = checkpoint_dir(run_dir)
    path, _ = engine.load_checkpoint(
        ckpt, tag=tag, load_module_only=module_only, load_optimizer_states=not module_only,
        load_lr_scheduler_states=not module_only,
    )
    if path is None:
        raise ValueError(f"checkpoint {os.path.join(ckpt, tag)} could not be loaded (missing shards?)")
    rng = os.path.join(ckpt, tag, f"rng_rank{dist.get_rank()}.pt")
    if restore_rng and os.path.exists(rng):
        _set_rng_state(torch.load(rng, weights_only=False))  # the run's own file (numpy RNG state inside)


def rotate(run_dir: str, state: RunState, keep: int) -> None:
    """Delete old checkpoints, keeping the newest ``keep``, the latest and those a resume needs."""
    if dist.get_rank() != 0:
        return
    ckpt = checkpoint_dir(run_dir)
    tags = sorted(t for t in os.listdir(ckpt) if t.startswith("phase") and os.path.isdir(os.path.join(ckpt, t)))
    with open(os.path.join(ckpt, POINTER)) as f:
        latest = f.read().strip()
    protected = set(tags[-keep:]) | {latest} | set(state.open_levels.values())
    for tag in tags:
        if tag not in protected and tag < latest:
            shutil.rmtree(os.path.join(ckpt, tag), ignore_errors=True)
