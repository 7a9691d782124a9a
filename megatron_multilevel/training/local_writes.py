"""One rank's writes of a checkpoint save, kept from putting the ranks' collectives out of step.

A save is collective, and DeepSpeed's part of it (``engine.save_checkpoint``, 0.19.8) runs on every
rank, in this order: global rank 0 makes the save directory, then a barrier; two all-reduces that
check the tag is the same on every rank (``checkpoint_tag_validation``, on by default); the model
states ``mp_rank_XX_model_states.pt``, written by data-parallel rank 0 of each model-parallel group;
under ZeRO, each rank's optimizer partition ``zero_pp_rank_R_mp_rank_XX_optim_states.pt`` and, on
global rank 0, DeepSpeed's recovery scripts (``zero_to_fp32.py``, ``zero_to_torch.py``) copied beside
the checkpoints; then a final barrier. A write that failed on one rank only (its disk full, its
file-size limit, a directory it cannot write) raised out of ``save_checkpoint`` on that rank alone:
it skipped the final barrier and went on to the save's exchange of failures while the other ranks
waited in that barrier, which hung the run (gloo matches the two collectives by their order).

So during a save each of those writes goes through ``LocalWrites``: every file and directory
DeepSpeed makes goes through the engine's ``checkpoint_engine`` (``save``, ``makedirs``), replaced for
the save by one that runs them there, and the scripts' copy (``_copy_recovery_script``, DeepSpeed's
only other write) is run there too. A write that fails is recorded (the first failure, as one line)
instead of raised, and the rank's later writes of the same save are skipped (the checkpoint is
removed anyway); ``save_checkpoint`` then runs to its end on every rank through the same
collectives, and the ranks exchange what failed only once it has returned (``checkpoint.save``).
The writes that follow it are skipped the same way, but for those that hold collectives themselves
(a cycle's files beside the checkpoint, gathered over the tensor-parallel ranks first:
``run_collective``), which run on every rank. No timeout is involved: the ranks never leave step. A
failure DeepSpeed swallowed itself (``makedirs`` of a checkpoint's directory, which it only logs) is
now the cause reported.

Not covered: under ``zero_optimization.offload_optimizer.device: nvme`` DeepSpeed also copies the
offloaded optimizer files, with ``shutil.copytree`` called directly: a failure there still raises on
its rank alone, as before. A decoupled (asynchronous) checkpoint engine, whose writes end after the
save returns, is not used by this project.
"""

import re
from typing import Callable, Optional


def failure_of(write: Callable[[], None]) -> Optional[str]:
    """Run ``write``; what made it fail, if the file system did. torch's writer (and DeepSpeed's,
    which uses it) reports a failed write as a ``RuntimeError`` (a full disk, a quota or a file-size
    limit mid-file: "file write failed", "unexpected pos"; a directory it could not create: "Parent
    directory ... does not exist"): those count as the file system's too."""
    try:
        write()
    except OSError as e:
        return f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
    except RuntimeError as e:
        said = re.sub(r"^\[enforce fail at [^\]]*\]\s*\.?\s*", "", (str(e).strip() or type(e).__name__).splitlines()[0])
        if "unexpected pos" in said or "file write failed" in said:
            return f"a write stopped part way: a full disk, a quota or a file-size limit; torch: {said}"
        return said
    return None


class LocalWrites:
    """This rank's writes of one save: the first that failed, as one line (``failure``); once one
    has failed, the others are skipped."""

    def __init__(self):
        self.failure: Optional[str] = None

    def run(self, write: Callable[[], None]) -> None:
        if self.failure is None:
            self.failure = failure_of(write)

    def run_collective(self, write: Callable[[], None]) -> None:
        """``write`` even after a failure, as it holds collectives that every rank must run; its
        failure recorded if it is the first."""
        failure = failure_of(write)
        self.failure = self.failure or failure


class _ContainedEngine:
    """DeepSpeed's checkpoint engine with its writes run through ``writes``; the rest is its own."""

    def __init__(self, inner, writes: LocalWrites):
        self.inner, self.writes = inner, writes

    def save(self, state_dict, path: str) -> None:
        self.writes.run(lambda: self.inner.save(state_dict, path))

    def makedirs(self, path, exist_ok=False) -> None:
        self.writes.run(lambda: self.inner.makedirs(path, exist_ok=exist_ok))

    def __getattr__(self, name):
        return getattr(self.inner, name)


RECOVERY_SCRIPTS = "_copy_recovery_script"
"""DeepSpeed's method that copies its recovery scripts (``shutil.copyfile``, global rank 0, under ZeRO)."""


def save_deepspeed_checkpoint(engine, save_dir: str, tag: str, writes: LocalWrites) -> None:
    """``engine.save_checkpoint(save_dir, tag)`` without DeepSpeed's ``latest`` (collective), every
    write of it through ``writes``: it returns on every rank, whatever failed on this one."""
    assert callable(getattr(type(engine), RECOVERY_SCRIPTS, None)), \
        f"DeepSpeed's engine has no {RECOVERY_SCRIPTS}: check its save_checkpoint's writes (local_writes.py)"
    inner, copy_scripts = engine.checkpoint_engine, getattr(engine, RECOVERY_SCRIPTS)
    engine.checkpoint_engine = _ContainedEngine(inner, writes)
    setattr(engine, RECOVERY_SCRIPTS, lambda path: writes.run(lambda: copy_scripts(path)))
    try:
        engine.save_checkpoint(save_dir, tag=tag, save_latest=False)
    finally:
        engine.checkpoint_engine = inner
        delattr(engine, RECOVERY_SCRIPTS)  # the instance's own: the class's method again
