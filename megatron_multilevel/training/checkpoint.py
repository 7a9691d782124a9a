"""Checkpoints: DeepSpeed's own (every ZeRO format) plus a small JSON sidecar.

``<run>/checkpoints/<tag>/`` holds what ``engine.save_checkpoint`` writes, one
``rng_rank<r>.pt`` per rank and ``multilevel.json``: the position in the cycle (phase, step,
global step), the level maps, where each coalesced level's pre-coalescing model is kept (the tag
of its checkpoint), counters and the finished phases. ``<run>/checkpoints/latest`` names the last
complete checkpoint and is replaced atomically after everything else is on disk, so a run killed
at any moment resumes from a complete checkpoint. The sidecar also records every file of the
checkpoint with its size and CRC-32 (``manifest.py``): a resume checks them first and falls back
to the previous complete checkpoint when a file is missing, truncated or altered. A save that
fails (a full disk, a permission) removes what it wrote, leaves ``latest`` and the previous
checkpoints as they were and ends the run with one line (``CheckpointError``).

A save's write can fail on one rank only (its disk, its quota, its file-size limit). No rank raises
in the middle of a save, whose steps are collective (DeepSpeed's own barriers and all-reduces among
them): each rank runs the whole save, every write of it (DeepSpeed's included: ``local_writes.py``
says how) through ``local_writes.LocalWrites``, which records a failed write instead of raising and
skips the rank's later writes but for those holding collectives. The ranks exchange what failed at
two points only, once the files are written and once the checkpoint is marked complete
(``_settle``): every rank then raises the same ``CheckpointError``, naming the first failure.
"""

import errno
import json
import os
import re
import shutil
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_multilevel.config.parsing import read_json_object
from megatron_multilevel.training import manifest
from megatron_multilevel.training.local_writes import LocalWrites, failure_of, save_deepspeed_checkpoint
from megatron_multilevel.training.safe_load import load_checkpoint_file

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
    the process right there with no cleanup at all, as a SIGKILL would. For the signal tests,
    ``MEGATRON_MULTILEVEL_PAUSE_AT=<where>[,<where>...]`` with ``MEGATRON_MULTILEVEL_PAUSE_FILE=<path>``
    holds each rank there (handling signals) from creating ``<path>.<rank>`` until it is removed."""
    if os.environ.get("MEGATRON_MULTILEVEL_CRASH_AT") == where:
        os._exit(137)
    if where in os.environ.get("MEGATRON_MULTILEVEL_PAUSE_AT", "").split(","):
        gate = f"{os.environ['MEGATRON_MULTILEVEL_PAUSE_FILE']}.{dist.get_rank()}"
        open(gate, "w").close()
        while os.path.exists(gate):
            time.sleep(0.05)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or no intact one is left to resume from."""


def fault_point(where: str) -> None:
    """Fault injection for the tests: ``MEGATRON_MULTILEVEL_FAIL_AT=<where>`` makes the write there
    fail as a full disk does."""
    if os.environ.get("MEGATRON_MULTILEVEL_FAIL_AT") == where:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


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
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        if os.path.exists(tmp):  # a write that failed leaves nothing behind
            os.remove(tmp)
        raise


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
    directory = os.path.join(ckpt, tag)
    rank = dist.get_rank()
    writes = LocalWrites()
    if rank == 0 and os.path.isdir(directory):
        writes.run(lambda: shutil.rmtree(directory))  # leftovers of a save that was killed
    dist.barrier()
    save_deepspeed_checkpoint(engine, ckpt, tag, writes)  # returns on every rank, whatever failed on this one
    crash_point(f"save:{tag}")  # DeepSpeed's files written, ours not yet, the checkpoint not marked complete

    def rng_file():
        fault_point(f"save:{tag}")
        torch.save(_rng_state(), os.path.join(directory, f"rng_rank{rank}.pt"))

    writes.run(rng_file)
    if extra is not None:  # on every rank, whatever failed before: it may hold collectives
        writes.run_collective(lambda: extra(directory))
    _settle(writes.failure, directory, run_dir)
    files = _manifest(directory)

    def mark_complete():
        sidecar = {"format": FORMAT_VERSION, "tag": tag, "world_size": dist.get_world_size(), **meta,
                   "state": asdict(state), "files": files}
        sidecar["checksum"] = _sidecar_checksum(sidecar)
        _atomic_write(os.path.join(directory, SIDECAR), json.dumps(sidecar, indent=1))
        _atomic_write(os.path.join(ckpt, POINTER), tag)

    _settle(failure_of(mark_complete) if rank == 0 else None, directory, run_dir)
    return tag


def _settle(failure: Optional[str], directory: str, run_dir: str) -> None:
    """Every rank learns whether any rank's write failed (collective); if one did, the checkpoint's
    directory is removed and every rank raises ``CheckpointError`` naming the checkpoint kept."""
    failures = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    failed = [f for f in failures if f is not None]
    if not failed:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
    dist.barrier()
    kept = latest_tag(run_dir)
    raise CheckpointError(
        f"checkpoint {directory} could not be written ({failed[0]}); "
        + (f"the last complete checkpoint, {kept}, is kept: free space and run the same command to resume"
           if kept else "no earlier checkpoint: the run starts afresh when run again")
    )


def _manifest(directory: str) -> dict:
    """Every file of ``directory`` (but the sidecar) with its size and CRC-32, each rank
    checksumming a share of them (collective; the ranks share the storage, as DeepSpeed's loading
    assumes)."""
    names = [manifest.list_files(directory, skip=(SIDECAR,)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(names, src=0)
    mine = manifest.entries(directory, names[0][dist.get_rank()::dist.get_world_size()])
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {name: entry for part in parts for name, entry in part.items()}


def latest_tag(run_dir: str) -> Optional[str]:
    """The tag ``latest`` names (the last checkpoint marked complete), or None before the first."""
    pointer = os.path.join(checkpoint_dir(run_dir), POINTER)
    if not os.path.exists(pointer):
        return None
    with open(pointer) as f:
        return checked_tag(f.read().strip(), pointer)


def checked_tag(tag: str, where: str) -> str:
    """``tag`` (read from ``where``) if it names a directory inside the checkpoints directory; a tag
    that leaves it (``../..``, an absolute path) is a ``ValueError``."""
    if not isinstance(tag, str) or tag in ("", ".", "..") or os.path.basename(tag) != tag:
        raise ValueError(f"{where} names the checkpoint {str(tag)[:80]!r}, which is not a directory inside the "
                         f"run's checkpoints directory; refused")
    return tag


def _sidecar_checksum(sidecar: dict) -> int:
    """CRC-32 of the sidecar's own fields (but this one), in a canonical JSON form: its position,
    counters and file list are checked as the files are."""
    fields = {k: v for k, v in sidecar.items() if k != "checksum"}
    return zlib.crc32(json.dumps(fields, sort_keys=True).encode())


def _read_sidecar(ckpt: str, tag: str) -> dict:
    path = os.path.join(ckpt, tag, SIDECAR)
    try:
        sidecar = read_json_object(path)
    except ValueError as e:
        raise ValueError(f"checkpoint {path} is unreadable ({e})") from None
    if sidecar.get("format") != FORMAT_VERSION:
        raise ValueError(f"checkpoint {path} has an unsupported format {sidecar.get('format')!r}")
    # sidecars written before they carried a checksum are read as they are (their files are checked)
    if "checksum" in sidecar and sidecar["checksum"] != _sidecar_checksum(sidecar):
        raise ValueError(f"{path} does not match the checksum written with it")
    for kept in sidecar.get("state", {}).get("open_levels", {}).values():  # tags a resume reads too
        checked_tag(kept, path)
    return sidecar


def _unloadable(directory: str, names: list[str]) -> Optional[str]:
    """What stops one of the checkpoint files ``names`` from being read (with the allowlist,
    memory-mapped), for a checkpoint whose sidecar lists no files to check; None if all read."""
    for name in names:
        path = os.path.join(directory, name)
        try:
            load_checkpoint_file(path, mmap=True)
        except Exception as e:  # noqa: BLE001 (whatever a damaged file raises: the checkpoint is damaged)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            return f"{path} cannot be read ({first})"
    return None


def _damage(ckpt: str, tag: str) -> tuple[Optional[str], Optional[dict]]:
    """What is wrong with checkpoint ``tag`` and the checkpoints it needs (its open levels'), each
    rank checking a share of the files (collective): None when they are intact (their sizes and
    checksums as recorded; where a sidecar records none, every pickled file loads); and the
    sidecar of ``tag`` where it could be read."""
    sidecar = None
    try:
        sidecar = _read_sidecar(ckpt, tag)
        needed = [(tag, sidecar)] + [(t, _read_sidecar(ckpt, t)) for t in sidecar["state"]["open_levels"].values()]
    except ValueError as e:
        found = str(e)
    else:
        found = None
        rank, world = dist.get_rank(), dist.get_world_size()
        for t, side in needed:
            files = side.get("files")
            if files is not None:
                found = manifest.problem(os.path.join(ckpt, t), files, sorted(files)[rank::world])
            else:  # no file list (an older sidecar): every pickled file must at least load
                pickles = sorted(n for n in os.listdir(os.path.join(ckpt, t)) if n.endswith(".pt"))
                found = _unloadable(os.path.join(ckpt, t), pickles[rank::world])
            if found:
                break
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, found)
    return next((p for p in problems if p is not None), None), sidecar


def read_resumable(run_dir: str, say: Callable[[str], None]) -> Optional[tuple[str, dict]]:
    """``(tag, sidecar)`` of the newest intact complete checkpoint (collective), or None for a fresh
    run. A damaged one is said in one line (``say``) and the one before it tried, down to the
    oldest; with none intact, ``CheckpointError``."""
    latest = latest_tag(run_dir)
    if latest is None:
        return None
    ckpt = checkpoint_dir(run_dir)
    older = sorted((t for t in os.listdir(ckpt) if re.fullmatch(r"phase\d+-step\d+", t) and t < latest
                    and os.path.exists(os.path.join(ckpt, t, SIDECAR))), reverse=True)
    for i, tag in enumerate([latest, *older]):
        damage, sidecar = _damage(ckpt, tag)
        if damage is None:
            return tag, sidecar
        following = f"resuming from the one before, {older[i]}" if i < len(older) else "none is left"
        say(f"checkpoint {tag} is damaged ({damage}); {following}")
    raise CheckpointError(f"no intact checkpoint is left in {ckpt}: restore one, or remove the directory to "
                          f"start afresh")


def read_latest(run_dir: str) -> Optional[tuple[str, dict]]:
    """``(tag, sidecar)`` of the last complete checkpoint, or None for a fresh run (its files
    unchecked: ``read_resumable`` checks them)."""
    tag = latest_tag(run_dir)
    if tag is None:
        return None
    try:
        return tag, _read_sidecar(checkpoint_dir(run_dir), tag)
    except ValueError as e:
        raise ValueError(f"{e}; remove {os.path.join(checkpoint_dir(run_dir), POINTER)} to start afresh") from None


def state_of(sidecar: dict) -> RunState:
    state = RunState(**sidecar["state"])
    state.open_levels = {int(k): v for k, v in state.open_levels.items()}
    return state


def check_no_code(directory: str) -> None:
    """Refuse a checkpoint any of whose pickled files (``*.pt``) names code (collective): each rank
    reads a share of them with ``weights_only=True`` and the allowlist of ``safe_load`` (memory-
    mapped: the pickles' structure is read, not the tensors), and every rank raises
    ``CheckpointError`` naming the first refusal. DeepSpeed's ``load_checkpoint`` unpickles with
    ``weights_only=False``, so nothing reaches it that this check has not passed: a run directory
    written by someone else (shared, copied, tampered with) cannot run code on resume."""
    names = sorted(n for n in os.listdir(directory) if n.endswith(".pt"))
    refusal = None
    for name in names[dist.get_rank()::dist.get_world_size()]:
        try:
            load_checkpoint_file(os.path.join(directory, name), mmap=True)
        except ValueError as e:
            refusal = str(e)
            break
    refusals = [None] * dist.get_world_size()
    dist.all_gather_object(refusals, refusal)
    refused = [r for r in refusals if r is not None]
    if refused:
        raise CheckpointError(f"checkpoint {directory} is refused: {refused[0]}")


def load(engine, run_dir: str, tag: str, *, module_only: bool = False, restore_rng: bool = True) -> None:
    """Load checkpoint ``tag`` into ``engine`` (collective), after :func:`check_no_code` passed its
    files: DeepSpeed's loading unpickles without restriction, the RNG states are read with the
    allowlist."""
    ckpt = checkpoint_dir(run_dir)
    check_no_code(os.path.join(ckpt, tag))
    path, _ = engine.load_checkpoint(
        ckpt, tag=tag, load_module_only=module_only, load_optimizer_states=not module_only,
        load_lr_scheduler_states=not module_only,
    )
    if path is None:
        raise ValueError(f"checkpoint {os.path.join(ckpt, tag)} could not be loaded (missing shards?)")
    rng = os.path.join(ckpt, tag, f"rng_rank{dist.get_rank()}.pt")
    if restore_rng and os.path.exists(rng):
        _set_rng_state(load_checkpoint_file(rng))


def rotate(run_dir: str, state: RunState, keep: int) -> None:
    """Delete old checkpoints, keeping the newest ``keep``, the latest and those a resume from any of
    them needs (the checkpoints of their coalesced levels)."""
    if dist.get_rank() != 0:
        return
    ckpt = checkpoint_dir(run_dir)
    tags = sorted(t for t in os.listdir(ckpt) if t.startswith("phase") and os.path.isdir(os.path.join(ckpt, t)))
    latest = latest_tag(run_dir)
    kept = set(tags[-keep:]) | {latest}
    protected = kept | set(state.open_levels.values())
    for tag in kept:  # and what each kept checkpoint needs to resume (a fall back may resume from it)
        if os.path.exists(os.path.join(ckpt, tag, SIDECAR)):
            protected |= set(_read_sidecar(ckpt, tag)["state"]["open_levels"].values())
    for tag in tags:
        if tag not in protected and tag < latest:
            shutil.rmtree(os.path.join(ckpt, tag), ignore_errors=True)
