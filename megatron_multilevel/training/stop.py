"""Stopping a run cleanly on a signal, as a scheduler asks: SIGTERM (SLURM's preemption and time
limit, ``kill``, ``timeout``) or SIGINT (Ctrl-C).

Every rank handles both signals (the launcher forwards them to every rank: ``launching/``). The
first one is a request: each rank finishes the step it is in, the ranks agree (one all-reduce per
step: a signal that reached one rank stops them all at the same step), the run saves a checkpoint
there (mid-phase too; a transition in progress finishes first), says which in one line and exits
with ``STOPPED_STATUS``. Run again, the same command resumes from it. A second signal (one arriving
``SAME_REQUEST_SECONDS`` or more after the first: a scheduler and the launcher may deliver one
request twice) exits at once: the checkpoint being written is not marked complete, ``latest`` stays
on the last complete one. ``training.stop_grace_seconds`` bounds the whole clean stop the same way.
"""

import ctypes
import os
import signal
import sys
import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

STOPPED_STATUS = 75
"""A run stopped on request, its checkpoint saved: ``EX_TEMPFAIL`` of sysexits.h (run it again)."""
SAME_REQUEST_SECONDS = 2.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(Exception):
    """The run stopped on a signal after saving checkpoint ``tag`` (``None``: nothing to save yet)."""

    def __init__(self, signal_name: str, global_step: int, tag: Optional[str], where: str):
        self.signal_name, self.global_step, self.tag, self.where = signal_name, global_step, tag, where
        saved = f"checkpoint {tag} saved in {where}" if tag else "no step trained yet, nothing to save"
        super().__init__(f"stopped by {signal_name} at global step {global_step}: {saved}; run the same command "
                         f"to resume")


class StopRequest:
    """The process's handler of SIGTERM and SIGINT (``install``), and the ranks' agreement on a stop
    (``agreed``)."""

    def __init__(self, grace_seconds: float = 0.0, say: Callable[[str], None] = None):
        self.grace_seconds = grace_seconds
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.signum: Optional[int] = None
        self.received_at = 0.0
        self.saved = False
        """The stop's checkpoint is complete: from then on, exiting at once loses nothing."""
        self._previous = {}

    def install(self) -> "StopRequest":
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self.received_at = signum, now
            if self.grace_seconds:
                timer = threading.Timer(self.grace_seconds, self._exit_now,
                                        (f"no clean stop within training.stop_grace_seconds={self.grace_seconds:g}",))
                timer.daemon = True
                timer.start()
            return
        if now - self.received_at < SAME_REQUEST_SECONDS:
            return  # the same request, delivered twice (to the process group and by the launcher)
        self._exit_now(f"a second {signal.Signals(signum).name}")

    def _exit_now(self, why: str) -> None:
        if self.saved:
            os._exit(STOPPED_STATUS)
        self.say(f"{why}: exiting now; the checkpoint in progress, if any, is not used (the last complete one "
                 f"stays latest)")
        os._exit(128 + (self.signum or signal.SIGTERM))

    def agreed(self) -> bool:
        """Whether any rank received a signal (collective over every rank: all call it at the same
        step, all get the same answer)."""
        received = torch.tensor([self.signum or 0], dtype=torch.int32,
                                device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(received, op=dist.ReduceOp.MAX)
        signum = int(received.item())
        if signum and self.signum is None:  # another rank's request
            self.signum, self.received_at = signum, time.monotonic()
        return bool(signum)


def die_with_parent() -> None:
    """Have the kernel send SIGTERM to this process when its parent exits (Linux), so that no rank
    or node launcher outlives the process that started it, whatever killed that one."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)
