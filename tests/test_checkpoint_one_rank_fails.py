"""A checkpoint save that fails on one rank only, part way through DeepSpeed's ``save_checkpoint``
(whose barriers and all-reduces every rank must run in step): every rank ends with the same one
line, nothing of the failed checkpoint is left, ``latest`` stays on the last complete one and the
same command resumes there to the uninterrupted run's losses. The faults are real: the kernel's
file-size limit set on that one rank's process, a path only rank 0 writes blocked by a directory."""

import os

import pytest

from distributed_helpers import run_ranks
from launch_helpers import KEEP_ALL, PausedRun, assert_close_to_reference, launch, ok, run_config

# seconds from the release of the paused ranks to their end: the failed save takes a few; ranks out
# of step wait for each other for ever
HANG = 300


def fail_one_rank_mid_save(reference, corpus, tmp_path, *, procs: int, failing: int, zero: int) -> None:
    """``procs`` ranks under ZeRO ``zero``, held after global step 7; rank ``failing`` then may write
    no file above 64 KiB, so its first write of the save at the end of phase 2 (global step 8), a
    file of DeepSpeed's, fails part way."""
    import psutil

    config = run_config(tmp_path, corpus, "run", training=KEEP_ALL, zero_optimization={"stage": zero})
    run = PausedRun(config, tmp_path, "step7", procs=procs)
    run.wait_paused()
    run.rank(failing).rlimit(psutil.RLIMIT_FSIZE, (64 << 10, 64 << 10))
    run.release()
    failed = run.finish_or_fail(HANG, f"rank {failing}'s save failed")
    said = failed.stdout[-3000:] + failed.stderr[-5000:]
    assert failed.returncode == 1, said
    assert run.survivors() == []
    ckpt = tmp_path / "run" / "checkpoints"
    lines = {line for line in failed.stderr.splitlines() if line.startswith("error:")}
    assert len(lines) == 1, said  # every rank says the same line
    (line,) = lines
    assert line.startswith(f"error: checkpoint {ckpt / 'phase01-step0000005'} could not be written (a write stopped "
                           f"part way: a full disk, a quota or a file-size limit; torch: "), line
    assert line.endswith("); the last complete checkpoint, phase01-step0000003, is kept: free space and run the "
                         "same command to resume"), line
    assert "Traceback" not in failed.stderr, said
    # nothing partial: the complete checkpoints, the pointer, DeepSpeed's recovery scripts (ZeRO)
    complete = {"phase00-step0000003", "phase01-step0000003"}
    scripts = {"zero_to_fp32.py", "zero_to_torch.py"} if zero else set()
    assert {p.name for p in ckpt.iterdir()} == complete | {"latest"} | scripts
    assert all((ckpt / tag / "multilevel.json").exists() for tag in complete)
    assert (ckpt / "latest").read_text().strip() == "phase01-step0000003"
    resumed = ok(launch(config, "--num_procs", procs))
    assert "resuming from phase01-step0000003" in resumed.stdout
    assert_close_to_reference(tmp_path / "run", reference, abs=2e-4)


def test_a_save_failing_on_rank_1_in_deepspeed_ends_both_ranks_in_one_line_and_resumes(reference, corpus, tmp_path):
    """ZeRO-1: rank 1's optimizer partition fails while rank 0 writes the model states and the
    recovery scripts and goes on to DeepSpeed's final barrier."""
    fail_one_rank_mid_save(reference, corpus, tmp_path, procs=2, failing=1, zero=1)


@pytest.mark.slow
def test_a_save_failing_on_rank_0_of_four_ends_every_rank_in_one_line_and_resumes(reference, corpus, tmp_path):
    """ZeRO-2 on four ranks: rank 0's model states fail (its partition and the scripts are then
    skipped) while ranks 1-3 write their partitions."""
    fail_one_rank_mid_save(reference, corpus, tmp_path, procs=4, failing=0, zero=2)


def _save_with_one_rank_failing(rank, world_size, run_dir, failing, fault):
    """A DeepSpeed engine under ZeRO-1 saved twice with ``checkpoint.save``; before the second save,
    ``fault`` on rank ``failing`` only. What each rank's second save raised, and what is on disk."""
    import resource

    import deepspeed
    import torch

    from megatron_multilevel.training import checkpoint

    model = torch.nn.Linear(64, 64)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_batch_size": world_size, "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}})
    state = checkpoint.RunState()
    checkpoint.save(engine, run_dir, state, meta={})
    state.step = 1
    ckpt = checkpoint.checkpoint_dir(run_dir)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == failing and fault == "file-size":  # this rank's optimizer partition (~25 KB) fails part way
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    elif rank == failing and fault == "recovery-script":  # DeepSpeed's copy beside the checkpoints fails
        os.remove(os.path.join(ckpt, "zero_to_fp32.py"))
        os.mkdir(os.path.join(ckpt, "zero_to_fp32.py"))
    try:
        checkpoint.save(engine, run_dir, state, meta={})
        said = None
    except checkpoint.CheckpointError as e:
        said = str(e)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    return said, checkpoint.latest_tag(run_dir), sorted(os.listdir(ckpt))


PARTITION = "a write stopped part way: a full disk, a quota or a file-size limit; torch: "


@pytest.mark.parametrize("world_size, failing, fault, cause", [
    pytest.param(2, 1, "file-size", PARTITION, id="2-ranks-partition"),
    pytest.param(2, 0, "recovery-script", "Is a directory: ", id="2-ranks-recovery-script"),
    pytest.param(4, 2, "file-size", PARTITION, id="4-ranks-partition", marks=pytest.mark.slow),
    pytest.param(4, 0, "recovery-script", "Is a directory: ", id="4-ranks-recovery-script", marks=pytest.mark.slow),
])
def test_a_write_failing_in_deepspeed_on_one_rank_raises_the_same_line_on_every_rank(tmp_path, world_size, failing,
                                                                                     fault, cause):
    """``checkpoint.save`` on real gloo ranks, a write inside DeepSpeed's ``save_checkpoint``
    failing on one rank only (its optimizer partition; on rank 0, the recovery script DeepSpeed
    copies last, just before its final barrier): every rank returns from DeepSpeed and raises the
    same ``CheckpointError`` naming the cause (no rank left waiting: the spawn's timeout), the failed
    checkpoint removed, ``latest`` on the first."""
    results = run_ranks(_save_with_one_rank_failing, world_size, tmp_path / "ranks", str(tmp_path / "run"), failing,
                        fault, timeout=90)
    first, failed = "phase00-step0000000", "phase00-step0000001"
    said = {r[0] for r in results}
    assert len(said) == 1, said
    (line,) = said
    assert line is not None and line.startswith(
        f"checkpoint {tmp_path / 'run' / 'checkpoints' / failed} could not be written ({cause}"), line
    assert line.endswith(f"the last complete checkpoint, {first}, is kept: free space and run the same command to "
                         f"resume"), line
    assert all(r[1] == first for r in results)
    assert results[0][2] == ["latest", first, "zero_to_fp32.py", "zero_to_torch.py"]
