"""Checkpoints that storage damaged or never finished: the files' sizes and checksums, the fall
back to the previous complete checkpoint, a save that fails on a full disk."""

import json
import os
import subprocess
import sys
import zlib

import pytest

from launch_helpers import (KEEP_ALL, ROOT, SAME_RUN, PausedRun, assert_close_to_reference, launch, ok, records,
                            run_config)

from megatron_multilevel.training import manifest


def test_manifest_records_sizes_and_crc32_and_names_the_bad_file(tmp_path):
    """Sizes and CRC-32 against zlib on the whole file's bytes; a truncated, an altered (same size)
    and a missing file each named; temporary files and the skipped names left out."""
    (tmp_path / "sub").mkdir()
    data = {"a.pt": os.urandom(5_000_001), "sub/b.pt": b"x" * 10, "empty": b""}
    for name, content in data.items():
        (tmp_path / name).write_bytes(content)
    (tmp_path / "c.json.tmp123").write_text("{}")
    (tmp_path / "multilevel.json").write_text("{}")
    names = manifest.list_files(str(tmp_path), skip=("multilevel.json",))
    assert names == sorted(data)
    files = manifest.entries(str(tmp_path), names)
    assert files == {name: [len(c), zlib.crc32(c)] for name, c in data.items()}
    assert manifest.problem(str(tmp_path), files) is None
    flipped = bytearray(data["a.pt"])
    flipped[4_999_999] ^= 1
    (tmp_path / "a.pt").write_bytes(bytes(flipped))
    assert "a.pt does not match the checksum" in manifest.problem(str(tmp_path), files)
    (tmp_path / "a.pt").write_bytes(data["a.pt"][:-1])
    assert "a.pt has 5000000 bytes, 5000001 when it was written" in manifest.problem(str(tmp_path), files)
    (tmp_path / "a.pt").unlink()
    assert "a.pt is missing" in manifest.problem(str(tmp_path), files)
    assert manifest.problem(str(tmp_path), files, ["sub/b.pt"]) is None  # a rank's share only


def _verify(path):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "inspect_checkpoint.py"), str(path), "--verify"],
                          capture_output=True, text=True, timeout=120)


def test_a_truncated_newest_checkpoint_falls_back_to_the_one_before(reference, corpus, tmp_path):
    """Killed in phase 2 (global step 12; checkpoints at global steps 3, 6, 8 and 9), the model file of
    the newest (phase 2, step 1) truncated as a partial copy leaves it: the resume says so in one
    line, starts from the end of phase 1, de-coalesces again and ends on the uninterrupted run's
    losses. inspect_checkpoint --verify names the file; it passes on an intact checkpoint."""
    config = run_config(tmp_path, corpus, "run")
    assert launch(config, env={"MEGATRON_MULTILEVEL_CRASH_AT": "step12"}).returncode != 0
    ckpt = tmp_path / "run" / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "phase02-step0000001"
    intact = _verify(tmp_path / "run")
    assert intact.returncode == 0 and "all intact" in intact.stdout, intact.stdout + intact.stderr
    (model_file,) = (ckpt / "phase02-step0000001").glob("mp_rank_00_model_states.pt")
    size = model_file.stat().st_size
    model_file.write_bytes(model_file.read_bytes()[: size // 2])
    bad = _verify(tmp_path / "run")
    assert bad.returncode == 1 and "mp_rank_00_model_states.pt has" in bad.stdout, bad.stdout + bad.stderr
    resumed = ok(launch(config))
    notices = [line for line in resumed.stdout.splitlines() if "is damaged" in line]
    assert notices == [f"checkpoint phase02-step0000001 is damaged ({model_file} has {size // 2} bytes, {size} when "
                       f"it was written); resuming from the one before, phase01-step0000005"], resumed.stdout[-3000:]
    assert len(notices) == 1 and "Traceback" not in resumed.stderr
    assert [r["global_step"] for r in records(tmp_path / "run", "resume")] == [8]
    assert_close_to_reference(tmp_path / "run", reference, **SAME_RUN)


def sidecar_checksum(sidecar: dict) -> int:
    """The sidecar's checksum as documented: CRC-32 of its other fields as canonical JSON."""
    return zlib.crc32(json.dumps({k: v for k, v in sidecar.items() if k != "checksum"}, sort_keys=True).encode())


@pytest.mark.parametrize("damage", ["edited-sidecar", pytest.param("no-file-list", marks=pytest.mark.slow)])
def test_a_damaged_sidecar_or_a_file_no_list_covers_falls_back(reference, corpus, tmp_path, damage):
    """The newest checkpoint's sidecar edited (its global step, which would shift the data the rest
    of the run reads), or written without a file list (as older sidecars were) over a truncated
    model file: the resume says the checkpoint is damaged in one line, starts from the one before
    and ends on the uninterrupted run's losses."""
    config = run_config(tmp_path, corpus, "run")
    assert launch(config, env={"MEGATRON_MULTILEVEL_CRASH_AT": "step12"}).returncode != 0
    newest = tmp_path / "run" / "checkpoints" / "phase02-step0000001"
    sidecar = json.loads((newest / "multilevel.json").read_text())
    assert sidecar["checksum"] == sidecar_checksum(sidecar)
    if damage == "edited-sidecar":
        sidecar["state"]["global_step"] += 1
        expected = f"{newest / 'multilevel.json'} does not match the checksum written with it"
    else:
        del sidecar["files"], sidecar["checksum"]
        (model_file,) = newest.glob("mp_rank_00_model_states.pt")
        model_file.write_bytes(model_file.read_bytes()[:1000])
        expected = f"{model_file} cannot be read ("
    (newest / "multilevel.json").write_text(json.dumps(sidecar))
    resumed = ok(launch(config))
    (notice,) = [line for line in resumed.stdout.splitlines() if "is damaged" in line]
    assert notice.startswith(f"checkpoint phase02-step0000001 is damaged ({expected}"), notice
    assert notice.endswith("resuming from the one before, phase01-step0000005"), notice
    assert "Traceback" not in resumed.stderr
    assert_close_to_reference(tmp_path / "run", reference, **SAME_RUN)


def test_no_intact_checkpoint_left_is_one_line(corpus, tmp_path):
    """Every complete checkpoint damaged: one line per checkpoint tried, then a clear error, no traceback."""
    config = run_config(tmp_path, corpus, "run", training={"save_interval": 0})
    assert launch(config, env={"MEGATRON_MULTILEVEL_CRASH_AT": "step5"}).returncode != 0
    (only,) = [d for d in (tmp_path / "run" / "checkpoints").iterdir() if d.is_dir()]
    sidecar = json.loads((only / "multilevel.json").read_text())
    assert sidecar["files"] and all(size >= 0 for size, _ in sidecar["files"].values())
    (only / "rng_rank0.pt").unlink()
    failed = launch(config)
    assert failed.returncode == 1
    assert f"checkpoint {only.name} is damaged ({only / 'rng_rank0.pt'} is missing); none is left" in failed.stdout
    assert "error: no intact checkpoint is left in" in failed.stderr and "Traceback" not in failed.stderr


def test_a_save_that_fails_keeps_the_last_checkpoint(reference, corpus, tmp_path):
    """The save at global step 6 fails as on a full disk (after DeepSpeed's files): one line, no
    traceback, its directory removed, `latest` still the checkpoint before; run again, the run
    resumes from there and ends on the uninterrupted run's losses."""
    config = run_config(tmp_path, corpus, "run", training=KEEP_ALL)
    failed = launch(config, env={"MEGATRON_MULTILEVEL_FAIL_AT": "save:phase01-step0000003"})
    assert failed.returncode == 1
    ckpt = tmp_path / "run" / "checkpoints"
    lines = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert lines == [f"error: checkpoint {ckpt / 'phase01-step0000003'} could not be written (No space left on "
                     f"device); the last complete checkpoint, phase00-step0000003, is kept: free space and run the "
                     f"same command to resume"], failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr
    assert not (ckpt / "phase01-step0000003").exists()
    assert (ckpt / "latest").read_text().strip() == "phase00-step0000003"
    ok(launch(config))
    assert_close_to_reference(tmp_path / "run", reference, **SAME_RUN)


def test_a_file_size_limit_reached_mid_save_removes_the_partial_checkpoint(reference, corpus, tmp_path):
    """A real write failure inside torch's writer: from global step 7 on, the rank may write no
    file above 64 KiB (the kernel's file-size limit, as a full disk or a quota fails a write part
    way). The save at the end of phase 2 (global step 8) fails inside DeepSpeed: one line naming the cause, no
    traceback, nothing of it left on disk, ``latest`` on the checkpoint before; run again without
    the limit, the run resumes there and ends on the uninterrupted run's losses."""
    import psutil

    config = run_config(tmp_path, corpus, "run", training=KEEP_ALL)
    run = PausedRun(config, tmp_path, "step7", procs=1)
    run.wait_paused()
    (rank,) = run.ranks()
    rank.rlimit(psutil.RLIMIT_FSIZE, (64 << 10, 64 << 10))
    run.release()
    failed = run.finish()
    assert failed.returncode == 1, failed.stdout[-3000:] + failed.stderr[-3000:]
    ckpt = tmp_path / "run" / "checkpoints"
    (line,) = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: checkpoint {ckpt / 'phase01-step0000005'} could not be written (a write "
                           f"stopped part way: a full disk, a quota or a file-size limit; "), line
    assert line.endswith("the last complete checkpoint, phase01-step0000003, is kept: free space and run the same "
                         "command to resume"), line
    assert "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert not (ckpt / "phase01-step0000005").exists()
    assert (ckpt / "latest").read_text().strip() == "phase01-step0000003"
    ok(launch(config))
    assert_close_to_reference(tmp_path / "run", reference, **SAME_RUN)


@pytest.mark.slow
def test_a_checkpoint_directory_that_cannot_be_made_is_one_line(corpus, tmp_path):
    """The save's directory cannot be created (a file stands where it goes: as a directory made
    unwritable does to DeepSpeed, which swallows the error and lets torch's writer fail): one
    line naming the checkpoint and the cause, no traceback, ``latest`` kept."""
    config = run_config(tmp_path, corpus, "run", training=KEEP_ALL)
    run = PausedRun(config, tmp_path, "step7", procs=1)
    run.wait_paused()
    blocker = tmp_path / "run" / "checkpoints" / "phase01-step0000005"
    blocker.write_text("not a directory")
    run.release()
    failed = run.finish()
    assert failed.returncode == 1, failed.stdout[-3000:] + failed.stderr[-3000:]
    (line,) = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: checkpoint {blocker} could not be written ("), line
    assert "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "phase01-step0000003"


# where a kill can land in the reference V-cycle (3 fine, 5 coarse, 5 fine steps; saves every 3
# global steps and at every phase's end), in the order a run passes them
KILL_POINTS = ([f"step{g}" for g in range(1, 4)] + ["save:phase00-step0000003", "transition1"]
               + [f"step{g}" for g in range(4, 9)] + ["save:phase01-step0000005", "transition2"]
               + [f"step{g}" for g in range(9, 13)] + ["save:phase02-step0000004"])


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_chaos_two_ranks_killed_and_a_truncated_file_end_on_the_uninterrupted_loss(reference, corpus, tmp_path, seed):
    """Two data-parallel ranks killed (as SIGKILL: no cleanup) at three moments drawn with ``seed``
    among steps, transitions and saves, resumed each time by the same command, with the newest
    checkpoint's model file truncated after the first kill that leaves two complete checkpoints
    (seeds 0 and 1: after their second and third kills): the run ends on the one-process
    uninterrupted run's losses. A failing seed reproduces: the kills are the seed's, in order."""
    import random

    kills = [KILL_POINTS[k] for k in sorted(random.Random(seed).sample(range(len(KILL_POINTS)), 3))]
    config = run_config(tmp_path, corpus, "run")
    ckpt = tmp_path / "run" / "checkpoints"
    planted, after = None, ""
    for kill in kills:
        result = launch(config, "--num_procs", 2, env={"MEGATRON_MULTILEVEL_CRASH_AT": kill})
        assert result.returncode != 0, (kills, kill, "not reached")
        if planted is not None:
            after += result.stdout
        complete = sorted(d for d in ckpt.glob("phase*") if (d / "multilevel.json").exists()) if ckpt.exists() else []
        if planted is None and len(complete) >= 2:
            newest = ckpt / (ckpt / "latest").read_text().strip()
            (planted,) = newest.glob("mp_rank_00_model_states.pt")
            planted.write_bytes(planted.read_bytes()[:100])
    after += ok(launch(config, "--num_procs", 2)).stdout
    assert planted is not None and after.count(f"({planted} has 100 bytes") == 1, (kills, after[-3000:])
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["totals"]["final_valid_loss"] == pytest.approx(
        json.loads((reference["dir"] / "summary.json").read_text())["totals"]["final_valid_loss"], abs=2e-4
    ), kills
    assert_close_to_reference(tmp_path / "run", reference, abs=2e-4)


class Payload:
    """Unpickling this calls ``exec``, which writes a file: what a planted checkpoint file would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_a_checkpoint_file_that_names_code_is_refused_on_resume_and_nothing_runs(corpus, tmp_path):
    """A pickle planted in the newest checkpoint's RNG file and in its DeepSpeed model file, their
    sizes and CRCs updated in the sidecar (as anyone who can write the files can): the resume refuses it in one line naming what the file
    asks for, and the payload never runs; the same file loaded without the allowlist runs it."""
    import torch

    config = run_config(tmp_path, corpus, "run")
    assert launch(config, env={"MEGATRON_MULTILEVEL_CRASH_AT": "step12"}).returncode != 0
    newest = tmp_path / "run" / "checkpoints" / "phase02-step0000001"
    marker = tmp_path / "code_ran"
    sidecar = json.loads((newest / "multilevel.json").read_text())
    for name in ("rng_rank0.pt", "mp_rank_00_model_states.pt"):  # ours, and one DeepSpeed unpickles
        path = newest / name
        state = torch.load(path, weights_only=False)
        torch.save({**state, "extra": Payload(marker)}, path)
        data = path.read_bytes()
        sidecar["files"][name] = [len(data), zlib.crc32(data)]
    sidecar["checksum"] = sidecar_checksum(sidecar)  # a checksum, not a signature: anyone can recompute it
    (newest / "multilevel.json").write_text(json.dumps(sidecar))
    rng = newest / "rng_rank0.pt"
    refused = launch(config)
    assert refused.returncode != 0 and not marker.exists()
    said = refused.stdout + refused.stderr
    assert f"checkpoint {newest} is refused" in said and "builtins.exec" in said, said[-3000:]
    assert "Traceback" not in refused.stderr, refused.stderr[-3000:]
    torch.load(rng, weights_only=False)  # the payload is live
    assert marker.read_text() == "ran"
