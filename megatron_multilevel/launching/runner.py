"""DeepSpeed's runner (``deepspeed``), as this project starts it::

    python -m megatron_multilevel.launching.runner [DeepSpeed runner arguments] --module megatron_multilevel.pretrain ...

Three changes to ``deepspeed.launcher.runner``, each made because the runner offers no option for it:

- SIGTERM and SIGINT are forwarded to the node launch it starts (on one node DeepSpeed's runner
  installs no handler: killed, it left the launch process and the ranks training as orphans); it
  then waits for them and exits with their status (75: stopped and saved, ``training/stop.py``).
- The node launch it starts is ``launching/node.py`` (DeepSpeed's, with the ranks given their
  grace period), on one node and through pdsh alike.
- With pdsh, DeepSpeed joins the arguments into a remote shell command quoting only those with a
  space (in double quotes, where ``$(...)`` still runs); here every argument is quoted for the shell.
"""

import logging
import shlex
import signal
import subprocess
import sys

from megatron_multilevel.extensions import first_build_notice

DEEPSPEED_NODE_LAUNCH = "deepspeed.launcher.launch"
NODE_LAUNCH = "megatron_multilevel.launching.node"


def node_command(cmd):
    """``cmd`` (a list, or pdsh's with the remote command among its items) with DeepSpeed's node
    launch module replaced by ours; also in pdsh's kill command, which names it short of its last
    character (``pkill -f python\\ -u\\ -m\\ deepspeed.launcher.launc``)."""
    return [NODE_LAUNCH if item == DEEPSPEED_NODE_LAUNCH else
            item.replace(DEEPSPEED_NODE_LAUNCH[:-1], NODE_LAUNCH[:-1]) if isinstance(item, str) else item
            for item in cmd]


def quoted_user_args(pdsh_runner) -> list[str]:
    """``PDSHRunner.parse_user_args``: every argument quoted as the remote shell reads it."""
    return [shlex.quote(arg) for arg in pdsh_runner.args.user_args]


class _Subprocess:
    """The ``subprocess`` module as the runner sees it: its ``Popen`` starts our node launch and
    remembers the process, to forward signals to."""

    children = []

    def __getattr__(self, name):
        return getattr(subprocess, name)

    def Popen(self, cmd, *args, **kwargs):  # noqa: N802 (the name the runner calls)
        process = subprocess.Popen(node_command(cmd), *args, **kwargs)
        self.children.append(process)
        return process


def _forward(signum, frame) -> None:
    for process in _Subprocess.children:
        if process.poll() is None:
            process.send_signal(signum)


def patch_deepspeed() -> None:
    """The runner's two changes in DeepSpeed's modules: pdsh's arguments quoted, our node launch."""
    from deepspeed.launcher import multinode_runner, runner

    multinode_runner.PDSHRunner.parse_user_args = quoted_user_args
    runner.subprocess = _Subprocess()


def main(argv=None) -> None:
    from deepspeed.launcher import runner

    argv = sys.argv[1:] if argv is None else argv
    if not any(a.split("=")[0] in ("-H", "--hostfile", "--num_nodes", "--force_multi") for a in argv):
        # one node and no hostfile is what is meant: the runner's warning that it found none is dropped
        logging.getLogger("DeepSpeed").addFilter(lambda r: not r.getMessage().startswith("Unable to find hostfile"))
    notice = first_build_notice()  # else the first run prints nothing for a minute or two
    if notice:
        print(notice, flush=True)
    patch_deepspeed()
    # pdsh across nodes installs its own handlers (it kills the remote commands); one node keeps these
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _forward)
    sys.argv = ["deepspeed", *argv]
    runner.main()


if __name__ == "__main__":
    main()
