"""A run stopped by a signal, as a scheduler stops it: SIGTERM to the launcher, Ctrl-C to the whole
process group, a second signal, a grace period. Real signals to the real launcher's processes."""

import os
import signal
import subprocess
import sys
import time

import pytest

from launch_helpers import ROOT, PausedRun, assert_close_to_reference, launch, ok, run_config

from megatron_multilevel.training.stop import STOPPED_STATUS


def stop_and_resume(reference, corpus, tmp_path, send) -> None:
    """Two ranks held after global step 7 (phase 2, between the periodic saves); ``send(run)``
    signals; both ranks stop after that step, the run saves ``phase01-step0000004``, says so in one
    line and exits with 75; no process survives; run again, it resumes there and ends on the
    one-process uninterrupted run's losses."""
    config = run_config(tmp_path, corpus, "run")
    run = PausedRun(config, tmp_path, "step7")
    run.wait_paused()
    send(run)
    time.sleep(0.5)
    run.release()
    result = run.finish()
    assert result.returncode == STOPPED_STATUS, result.stdout[-3000:] + result.stderr[-3000:]
    ckpt = tmp_path / "run" / "checkpoints"
    assert [line for line in result.stdout.splitlines() if line.startswith("stopped")] == [
        f"stopped by SIGTERM at global step 7: checkpoint phase01-step0000004 saved in {ckpt}; run the same command "
        f"to resume"]
    assert "Traceback" not in result.stderr and "ERROR" not in result.stderr + result.stdout, result.stderr[-3000:]
    assert run.survivors() == []
    assert (ckpt / "latest").read_text().strip() == "phase01-step0000004"
    resumed = ok(launch(config, "--num_procs", 2))
    assert "resuming from phase01-step0000004" in resumed.stdout
    assert_close_to_reference(tmp_path / "run", reference, abs=2e-4)


def test_sigterm_to_the_launcher_saves_stops_every_rank_and_resumes_on_the_uninterrupted_losses(
        reference, corpus, tmp_path):
    """SIGTERM to the launcher alone (``kill``, ``timeout``, ``srun``): it reaches both ranks."""
    stop_and_resume(reference, corpus, tmp_path, lambda run: run.process.send_signal(signal.SIGTERM))


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_both_at_the_same_step(reference, corpus, tmp_path):
    """SIGTERM to rank 1 alone: rank 0 learns of it at the step's agreement and stops there too."""
    stop_and_resume(reference, corpus, tmp_path, lambda run: next(
        p for p in run.ranks() if "--local_rank=1" in p.cmdline()).send_signal(signal.SIGTERM))


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_stops_cleanly_once(reference, corpus, tmp_path):
    """SIGINT to every process of the run at once (Ctrl-C in a terminal; a scheduler signalling the
    job step): each rank receives it twice (from the terminal and from its launcher) and treats it
    as one request; no traceback, status 75, nothing survives, the resumed run ends on the losses."""
    config = run_config(tmp_path, corpus, "run")
    run = PausedRun(config, tmp_path, "step10")
    run.wait_paused()
    os.killpg(run.process.pid, signal.SIGINT)
    time.sleep(0.5)
    run.release()
    result = run.finish()
    assert result.returncode == STOPPED_STATUS, result.stdout[-3000:] + result.stderr[-3000:]
    assert "stopped by SIGINT at global step 10: checkpoint phase02-step0000002 saved" in result.stdout
    assert "Traceback" not in result.stderr and "KeyboardInterrupt" not in result.stderr, result.stderr[-3000:]
    assert run.survivors() == []
    ok(launch(config, "--num_procs", 2))
    assert_close_to_reference(tmp_path / "run", reference, abs=2e-4)


@pytest.mark.slow
def test_a_second_signal_during_the_stop_save_exits_at_once_and_keeps_the_last_complete_checkpoint(
        reference, corpus, tmp_path):
    """SIGTERM at global step 7, then, while the stop's checkpoint is being written (DeepSpeed's
    files on disk, the checkpoint not yet complete), a second SIGTERM: the ranks exit at once
    (143), ``latest`` stays on the periodic checkpoint of global step 6, and the run resumes from
    it to the uninterrupted losses."""
    config = run_config(tmp_path, corpus, "run")
    run = PausedRun(config, tmp_path, "step7", "save:phase01-step0000004")
    run.wait_paused()
    run.process.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    run.release()
    run.wait_paused()  # in the stop's save
    time.sleep(2.5)  # a second request, not the first delivered twice
    run.process.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    run.release()
    result = run.finish()
    assert result.returncode == 128 + signal.SIGTERM, result.stdout[-3000:] + result.stderr[-3000:]
    assert "a second SIGTERM: exiting now" in result.stderr
    assert run.survivors() == []
    ckpt = tmp_path / "run" / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "phase01-step0000003"
    resumed = ok(launch(config, "--num_procs", 2))
    assert "resuming from phase01-step0000003" in resumed.stdout
    assert_close_to_reference(tmp_path / "run", reference, abs=2e-4)


HANDLER = """
import os, signal, sys, time
from megatron_multilevel.training.stop import StopRequest
stop = StopRequest(grace_seconds=float(sys.argv[1])).install()
os.kill(os.getpid(), signal.SIGTERM)
print(stop.name, flush=True)
time.sleep(float(sys.argv[2]))
stop.saved = sys.argv[3] == "saved"
os.kill(os.getpid(), signal.SIGTERM)
print("still running", flush=True)
time.sleep(float(sys.argv[4]))
"""


@pytest.mark.parametrize("grace, gap, saved, stay, status, says", [
    (0, 0.1, "", 0, 0, "still running"),  # the same request twice within 2 s: one request
    (0, 2.5, "", 0, 128 + signal.SIGTERM, "a second SIGTERM: exiting now"),
    (0, 2.5, "saved", 0, STOPPED_STATUS, ""),  # its checkpoint complete: nothing is lost, the stop's status
    (0.5, 0, "", 5, 128 + signal.SIGTERM, "no clean stop within training.stop_grace_seconds=0.5: exiting now"),
])
def test_the_handler_second_signal_and_grace(grace, gap, saved, stay, status, says):
    """The rank's handler alone, with real signals: a request, the same request again, a second
    request, the grace period running out."""
    result = subprocess.run([sys.executable, "-c", HANDLER, str(grace), str(gap), saved, str(stay)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == status, result.stderr
    assert result.stdout.startswith("SIGTERM")
    assert says in result.stdout + result.stderr


def test_pdsh_runs_the_overrides_as_given_and_nothing_else(tmp_path):
    """DeepSpeed's pdsh runner joins the arguments into a remote shell command: with the launcher's
    quoting, overrides holding ``$(...)`` and ``;`` reach the rank as written and run nothing (the
    remote command run here by bash, the interpreter replaced by ``printf``); the remote and kill
    commands name this project's node launch."""
    from deepspeed.launcher import multinode_runner
    from deepspeed.launcher import runner as ds_runner

    from megatron_multilevel.launching import runner

    marker = tmp_path / "ran"
    overrides = [f"training.output_dir=runs/$(touch {marker})", f"data.prefix=a;touch {marker}", "x=it's"]
    original = multinode_runner.PDSHRunner.parse_user_args
    try:
        runner.patch_deepspeed()
        args = ds_runner.parse_args(["--module", "megatron_multilevel.pretrain", "--config", "c.json", *overrides])
        cmd, kill, _ = multinode_runner.PDSHRunner(args, "e30=").get_cmd({}, {"node0": [0], "node1": [0]})
    finally:
        multinode_runner.PDSHRunner.parse_user_args = original
    cmd, kill = runner.node_command(cmd), runner.node_command(kill)
    remote = " ".join(cmd[cmd.index("-w") + 2:])
    assert f"{sys.executable} -u -m megatron_multilevel.launching.node" in remote
    assert "megatron_multilevel.launching.nod" in " ".join(kill) and "deepspeed.launcher" not in " ".join(kill)
    printed = subprocess.run(["bash", "-c", remote.replace(f"{sys.executable} -u -m", "printf '%s\\n'")],
                             capture_output=True, text=True, cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.splitlines()[-3:] == overrides
    assert not marker.exists()
