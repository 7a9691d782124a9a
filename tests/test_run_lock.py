"""One run per directory: a run started on a directory another run holds is refused in one line
naming the holder, before it writes anything; the lock of a run that died is taken over with a
notice; an ended run leaves the lock free."""

import fcntl
import json

from launch_helpers import launch, ok, run_config


def test_a_held_directory_is_refused_and_a_dead_holders_lock_taken_over(corpus, tmp_path):
    config = run_config(tmp_path, corpus, "run")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = {"host": "node7", "pid": 4242, "started": "2026-12-01 10:00:00"}
    with open(run_dir / "run.lock", "a+") as held:  # another process holds it: the kernel's lock, as a run's
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write(json.dumps(holder))
        held.flush()
        refused = launch(config)
    assert refused.returncode == 1, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert (f"error: {run_dir} is in use by another run (pid 4242 on host node7 since 2026-12-01 10:00:00): one run "
            "per directory") in refused.stderr, refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == ["run.lock"]  # nothing of the run written
    # the holder is gone (its lock with it), its name still in the file: taken over, said once
    done = ok(launch(config))
    notices = [line for line in done.stdout.splitlines() if "taking over the lock" in line]
    assert notices == [f"{run_dir / 'run.lock'}: taking over the lock of a run that is no longer running (pid 4242 "
                       "on host node7 since 2026-12-01 10:00:00)"], done.stdout[-3000:]
    assert (run_dir / "summary.json").exists()
    assert (run_dir / "run.lock").read_text() == ""  # ended: it names nobody, and nothing holds it
    with open(run_dir / "run.lock", "a+") as free:
        fcntl.flock(free, fcntl.LOCK_EX | fcntl.LOCK_NB)
