"""A stop requested of one rank only (a SIGTERM to that rank's process, not to the launcher, which
would forward it to every rank): every rank stops at the same step, the step the signal reached."""

import json
import signal
import time

from launch_helpers import PausedRun, run_config

from megatron_multilevel.training.stop import STOPPED_STATUS

# seconds from the release of the paused ranks to their end; ranks that disagree on the step wait
# for each other for ever
HANG = 300


def test_sigterm_to_rank_1_alone_stops_both_ranks_at_its_step(corpus, tmp_path):
    """Both ranks held after global step 2 (phase 1, between saves); SIGTERM to rank 1 only: rank 0
    learns of it at that step's agreement; the two save the same checkpoint there (one sidecar at
    global step 2, each rank's RNG file) and exit with 75, rank 0 saying so in one line; no process
    survives."""
    config = run_config(tmp_path, corpus, "run")
    run = PausedRun(config, tmp_path, "step2")
    run.wait_paused()
    run.rank(1).send_signal(signal.SIGTERM)
    time.sleep(0.5)
    run.release()
    result = run.finish_or_fail(HANG, "rank 1 alone was signalled")
    said = result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == STOPPED_STATUS, said
    ckpt = tmp_path / "run" / "checkpoints"
    assert [line for line in result.stdout.splitlines() if line.startswith("stopped")] == [
        f"stopped by SIGTERM at global step 2: checkpoint phase00-step0000002 saved in {ckpt}; run the same command "
        f"to resume"], said
    assert "Traceback" not in result.stderr, said
    assert run.survivors() == []
    assert (ckpt / "latest").read_text().strip() == "phase00-step0000002"
    saved = ckpt / "phase00-step0000002"
    assert json.loads((saved / "multilevel.json").read_text())["state"]["global_step"] == 2
    assert (saved / "rng_rank0.pt").exists() and (saved / "rng_rank1.pt").exists()
