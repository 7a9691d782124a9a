"""What reaches the console is what a user can act on: the library warnings known to say nothing are
dropped, in a tool's process and in the ranks it starts, and nothing else; DeepSpeed's line on a
rank's status is dropped only where the rank has said why it ended."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from megatron_multilevel.compat import KNOWN_WARNINGS, quiet_library_notices
from megatron_multilevel.launching.node import ERROR_SAID, mark_error_said, said_by_the_rank

ROOT = Path(__file__).resolve().parent.parent
MEGATRON_IMPORT = "import megatron.core.optimizer"
APEX = "Transformer Engine and Apex are not installed"


def _python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=300)


def test_megatrons_fallback_warnings_are_dropped_here_and_in_started_processes(monkeypatch):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    loud = _python(MEGATRON_IMPORT, env)
    assert loud.returncode == 0 and APEX in loud.stderr  # what a tool printed before
    quiet = _python(f"from megatron_multilevel.compat import quiet_library_notices; quiet_library_notices(); "
                    f"{MEGATRON_IMPORT}", env)
    assert (quiet.returncode, quiet.stderr) == (0, "")
    # a process it starts (a tool's ranks import Megatron-Core before any code of theirs runs)
    monkeypatch.delenv("PYTHONWARNINGS", raising=False)
    quiet_library_notices()
    quiet_library_notices()  # idempotent: each entry once
    child = _python(MEGATRON_IMPORT, dict(os.environ))
    assert (child.returncode, child.stderr) == (0, "")
    entries = os.environ["PYTHONWARNINGS"].split(",")
    assert len(entries) == len(set(entries)) == sum(len(modules) for *_, modules in KNOWN_WARNINGS)


def test_only_the_known_warnings_are_dropped():
    quiet_library_notices()
    for start, category, modules in KNOWN_WARNINGS:
        for module in modules:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                quiet_library_notices()  # its filters ahead of "always"
                warnings.warn_explicit(f"{start}. more", category, "x.py", 1, module=module)
                warnings.warn_explicit("something else", category, "x.py", 1, module=module)
                warnings.warn_explicit(f"{start}. more", category, "x.py", 1, module=module + ".other")
            assert [str(w.message) for w in seen] == ["something else", f"{start}. more"], (start, module)


def test_deepspeeds_line_on_a_status_the_rank_has_said_is_dropped(tmp_path, monkeypatch):
    marker = str(tmp_path / "said")
    line = "['python', '-u', '-m', 'megatron_multilevel.pretrain', '--local_rank=0'] exits with return code = {}"
    assert said_by_the_rank(line.format(75), marker)  # stopped on request: the rank said so
    assert not said_by_the_rank(line.format(1), marker)  # a traceback: DeepSpeed's line stays
    assert not said_by_the_rank(line.format(-9), marker)  # killed
    monkeypatch.setenv(ERROR_SAID, marker)
    mark_error_said()  # the rank's one-line error
    mark_error_said()  # a second rank: the same mark
    assert said_by_the_rank(line.format(1), marker)
    assert not said_by_the_rank(line.format(-9), marker) and not said_by_the_rank("Killing subprocess 12", marker)
    monkeypatch.delenv(ERROR_SAID)
    os.unlink(marker)
    mark_error_said()  # not started by the node launch: nothing
    assert not os.path.exists(marker)
