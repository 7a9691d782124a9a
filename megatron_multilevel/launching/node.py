"""DeepSpeed's node launch (``deepspeed.launcher.launch``: starts this node's ranks and watches
them), as ``launching/runner.py`` starts it.

DeepSpeed's launch answers SIGTERM and SIGINT by terminating its ranks and killing them 30 s later,
then exits 1: a rank saving a checkpoint on the signal (``training/stop.py``) would be killed
mid-save, and the status would not say that the run stopped cleanly. Here the signal is forwarded
to the ranks and the launch keeps watching them: they save, exit with 75 and the launch exits with
that status (DeepSpeed's own handling of a rank that exits with an error is unchanged: it stops
the others). And this process dies with the runner that started it, so no rank outlives it.

DeepSpeed's launch logs ``[ERROR] ... <command> exits with return code = N`` for a rank that ends
with a status other than 0. That line is dropped where it adds nothing: for a rank that stopped on
request (75, said by the rank), and for one that stopped on an error it has said in one line
(``error: ...``, status 1: the rank marks it, :func:`mark_error_said`); a rank that ended any other
way (a traceback, a signal) keeps it.
"""

import os
import re
import secrets
import signal
import sys
import tempfile

# set for the ranks by the node launch: the file a rank creates once it has said its error in one line
ERROR_SAID = "MEGATRON_MULTILEVEL_ERROR_SAID"


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


def mark_error_said() -> None:
    """Tell the node launch that this rank has said the error it stops on, in one line (a rank
    started by it; elsewhere nothing)."""
    if os.environ.get(ERROR_SAID):
        try:
            open(os.environ[ERROR_SAID], "x").close()  # created, never followed through a link
        except FileExistsError:  # another rank said it first
            pass


def said_by_the_rank(message: str, marker: str) -> bool:
    """Whether DeepSpeed's log line ``message`` is its line on a rank's status that the rank has
    already said: stopped on request, or an error marked in ``marker``."""
    from megatron_multilevel.training.stop import STOPPED_STATUS

    status = re.search(r"exits with return code = (-?\d+)$", message)
    if status is None:
        return False
    return int(status[1]) == STOPPED_STATUS or (int(status[1]) == 1 and os.path.exists(marker))


def main() -> None:
    import logging

    from deepspeed.launcher import launch

    from megatron_multilevel.training.stop import die_with_parent

    die_with_parent()
    # created by a rank only when it says its error: nothing is left behind otherwise, even by a kill
    marker = os.environ[ERROR_SAID] = os.path.join(tempfile.gettempdir(),
                                                   f"megatron-multilevel-error-said-{secrets.token_hex(8)}")
    logging.getLogger("DeepSpeed").addFilter(lambda r: not said_by_the_rank(r.getMessage(), marker))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _forward)
    launch.signal = _Signals()
    try:
        launch.main()
    finally:
        if os.path.exists(marker):
            os.unlink(marker)


if __name__ == "__main__":
    sys.exit(main())
