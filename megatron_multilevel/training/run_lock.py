"""One run per directory: a run holds an exclusive lock on ``<output_dir>/run.lock`` while it runs.

A second job started on the same ``output_dir`` (a requeued job beside an orphan, a typo in a
sweep) would otherwise replace the first one's metrics, config and checkpoints while both print
their own results. The lock is the kernel's (``fcntl.flock`` on the open file, held by global rank
0), so it dies with its holder however that ends; the file says who holds it (host, pid, start
time). A file left with a holder's name but no lock on it is what a killed run leaves: the next run
takes it over and says so in one line. (``flock`` holds across hosts on local disks and NFSv4;
file systems that ignore it let a second run through, as before.)
"""

import fcntl
import json
import os
import socket
import time
from typing import Callable, Optional

import torch.distributed as dist

LOCK_FILE = "run.lock"


class RunDirectoryLock:
    """The lock of one run directory, held by the process that made it (global rank 0)."""

    def __init__(self, output_dir: str, say: Callable[[str], None]):
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, LOCK_FILE)
        self.file = open(self.path, "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # the holder writes its name just after it takes the lock: give it a moment to appear
            deadline = time.monotonic() + 2.0
            while (holder := self._holder(missing=None)) is None and time.monotonic() < deadline:
                time.sleep(0.05)
            holder = holder or "holder unknown"
            self.file.close()
            raise ValueError(f"{output_dir} is in use by another run ({holder}): one run per directory; wait "
                             f"for it to end, stop it, or give this run another training.output_dir") from None
        previous = self._holder(missing=None)
        if previous is not None:
            say(f"{self.path}: taking over the lock of a run that is no longer running ({previous})")
        self.file.seek(0)
        self.file.truncate()
        json.dump({"host": socket.gethostname(), "pid": os.getpid(),
                   "started": time.strftime("%Y-%m-%d %H:%M:%S")}, self.file)
        self.file.flush()

    def _holder(self, missing: Optional[str] = "holder unknown") -> Optional[str]:
        """Who the file names, as ``pid P on host H since T``; ``missing`` where it names nobody."""
        self.file.seek(0)
        text = self.file.read().strip()
        if not text:
            return missing
        try:
            h = json.loads(text)
            return f"pid {h['pid']} on host {h['host']} since {h['started']}"
        except (ValueError, KeyError, TypeError):
            return f"{LOCK_FILE} reads {text[:80]!r}"

    def release(self) -> None:
        """The file emptied (an ended run names nobody) and the lock let go."""
        if self.file.closed:
            return
        self.file.seek(0)
        self.file.truncate()
        self.file.flush()
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


def hold_run_directory(output_dir: str, say: Callable[[str], None]) -> Optional[RunDirectoryLock]:
    """Global rank 0 takes ``output_dir``'s lock (collective); every rank raises ``ValueError`` with
    its one line if another run holds it. Returns the lock on rank 0, None on the others."""
    lock, refusal = None, None
    if dist.get_rank() == 0:
        try:
            lock = RunDirectoryLock(output_dir, say)
        except ValueError as e:
            refusal = str(e)
    said = [refusal]
    dist.broadcast_object_list(said, src=0)
    if said[0] is not None:
        raise ValueError(said[0])
    return lock
