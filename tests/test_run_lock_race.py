"""Two processes racing for one run directory's lock (``training/run_lock.py``), each as a run's
rank 0 takes it: exactly one holds it, the other is refused in one line naming the holder."""

import fcntl
import re
import socket
import subprocess
import sys
import time

from launch_helpers import ROOT

CONTENDER = """
import os, sys, time
from megatron_multilevel.training.run_lock import RunDirectoryLock
directory, go, done = sys.argv[1:4]
open(f"{go}.ready{os.getpid()}", "w").close()
while not os.path.exists(go):
    time.sleep(0.001)
try:
    lock = RunDirectoryLock(directory, print)
except ValueError as e:
    print(f"refused: {e}", flush=True)
    sys.exit(1)
print(f"holds: {os.getpid()}", flush=True)
while not os.path.exists(done):
    time.sleep(0.01)
lock.release()
"""


def test_two_processes_racing_for_a_directory_one_holds_it_the_other_is_refused(tmp_path):
    """Both started, both ready (imports done), then let go at once: one takes the lock and holds
    it, the other ends at once with status 1 and one line naming the holder's pid and host. The
    holder ended, the lock is free and its file names nobody."""
    directory, go, done = tmp_path / "run", tmp_path / "go", tmp_path / "done"
    procs = [subprocess.Popen([sys.executable, "-c", CONTENDER, str(directory), str(go), str(done)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("go.ready*"))) < 2:
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            assert time.monotonic() < deadline, "the contenders never got ready"
            time.sleep(0.05)
        go.touch()
        deadline = time.monotonic() + 30
        while all(p.poll() is None for p in procs):  # the refused one ends; the holder waits for `done`
            assert time.monotonic() < deadline, "neither contender was refused: both hold the directory"
            time.sleep(0.05)
    finally:
        done.touch()
    outputs = [p.communicate(timeout=60) for p in procs]
    (holder,) = [p for p, (out, _) in zip(procs, outputs) if out.startswith("holds: ")]
    (refused,) = [p for p in procs if p is not holder]
    out, _ = outputs[procs.index(refused)]
    assert refused.returncode == 1 and holder.returncode == 0, outputs
    (line,) = out.splitlines()
    expected = (rf"refused: {re.escape(str(directory))} is in use by another run \(pid {holder.pid} on host "
                rf"{re.escape(socket.gethostname())} since \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d\): one run per "
                r"directory; wait for it to end, stop it, or give this run another training\.output_dir")
    assert re.fullmatch(expected, line), line
    assert outputs[procs.index(holder)][0].splitlines() == [f"holds: {holder.pid}"], outputs  # no takeover said
    assert (directory / "run.lock").read_text() == ""
    with open(directory / "run.lock", "a+") as free:
        fcntl.flock(free, fcntl.LOCK_EX | fcntl.LOCK_NB)
