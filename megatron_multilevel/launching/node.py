"""DeepSpeed's node launch (``deepspeed.launcher.launch``: starts this node's ranks and watches
them), as ``launching/runner.py`` starts it.

DeepSpeed's launch answers SIGTERM and SIGINT by terminating its ranks and killing them 30 s later,
then exits 1: a rank saving a checkpoint on the signal (``training/stop.py``) would be killed
mid-save, and the status would not say that the run stopped cleanly. Here the signal is forwarded
to the ranks and the launch keeps watching them: they save, exit with 75 and the launch exits with
that status (DeepSpeed's own handling of a rank that exits with an error is unchanged: it stops
the others). And this process dies with the runner that started it, so no rank outlives it.
"""

import signal
import sys


class _Signals:
    """The ``signal`` module as DeepSpeed's launch sees it: its SIGTERM and SIGINT handlers are not
    installed (ours are)."""

    def __getattr__(self, name):
        return getattr(signal, name)

    @staticmethod
    def signal(signum, handler):
        if signum in (signal.SIGTERM, signal.SIGINT):
            return signal.getsignal(signum)
        return signal.signal(signum, handler)


def _forward(signum, frame) -> None:
    import psutil

    for child in psutil.Process().children():
        try:
            child.send_signal(signum)
        except psutil.NoSuchProcess:
            pass


def main() -> None:
    import logging

    from deepspeed.launcher import launch

    from megatron_multilevel.training.stop import STOPPED_STATUS, die_with_parent

    die_with_parent()
    # a rank that stopped on request has said so; DeepSpeed's error line on its status is dropped
    logging.getLogger("DeepSpeed").addFilter(lambda r: f"return code = {STOPPED_STATUS}" not in r.getMessage())
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _forward)
    launch.signal = _Signals()
    launch.main()


if __name__ == "__main__":
    sys.exit(main())
