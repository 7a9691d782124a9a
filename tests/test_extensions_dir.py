"""DeepSpeed's compiled ops live in one folder for the launcher, make and every tool, and the first
build is said before the minute or two it takes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_multilevel import extensions
from megatron_multilevel.extensions import SHM_COMM_OP, default_extensions_dir, first_build_notice

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / ".cache" / "torch_extensions"


def test_the_launcher_make_and_the_package_name_one_folder():
    from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

    assert default_extensions_dir() == str(FOLDER)
    assert "export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions" in (ROOT / "Makefile").read_text()
    launcher = (ROOT / "launch" / "pretrain_vcycle.sh").read_text()
    assert 'export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$root/.cache/torch_extensions}"' in launcher
    assert ShareMemCommBuilder.NAME == SHM_COMM_OP  # the op whose build the notice looks for


@pytest.mark.skipif(torch.cuda.is_available(), reason="DeepSpeed builds its CPU communication op only on CPU")
def test_a_tool_loads_the_op_the_launcher_built(tmp_path):
    """A tool's process (``init_single_process``: to-hf, inspect, the benchmarks) with no
    TORCH_EXTENSIONS_DIR builds and loads DeepSpeed's op in the repository's folder, not under $HOME."""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    env.update(HOME=str(tmp_path), XDG_CACHE_HOME=str(tmp_path / ".cache"))
    code = ("from megatron_multilevel.distributed import init_single_process; init_single_process(); "
            "import os; print('folder', os.environ['TORCH_EXTENSIONS_DIR'])")
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"folder {FOLDER}" in result.stdout.splitlines()
    assert (FOLDER / SHM_COMM_OP / f"{SHM_COMM_OP}.so").is_file()
    assert not (tmp_path / ".cache" / "torch_extensions").exists()


def test_the_first_build_is_said_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    notice = first_build_notice()
    assert notice == (f"DeepSpeed compiles its CPU communication op (deepspeed_shm_comm) into {tmp_path} the first "
                      f"time: about 1-2 minutes on 2 cores, once")
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")  # no such op on GPU
    assert first_build_notice() is None
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    built = tmp_path / SHM_COMM_OP / f"{SHM_COMM_OP}.so"
    built.parent.mkdir()
    built.touch()
    assert first_build_notice() is None
    # unset: the repository's folder, as the launcher's
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert extensions.use_extensions_dir() == str(FOLDER) == os.environ["TORCH_EXTENSIONS_DIR"]


def test_the_launcher_and_a_tool_say_it_before_the_build(tmp_path, monkeypatch, capsys):
    """The launcher's runner says it before DeepSpeed's launcher starts the ranks; a tool, before its
    one-process group loads the op."""
    import signal

    from deepspeed.launcher import runner as deepspeed_runner

    from megatron_multilevel import distributed
    from megatron_multilevel.launching import runner

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    started = []
    monkeypatch.setattr(deepspeed_runner, "main", lambda: started.append(list(sys.argv)))
    monkeypatch.setattr(runner, "patch_deepspeed", lambda: None)
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    runner.main(["--num_gpus", "1", "--module", "megatron_multilevel.pretrain", "--config", "c.json"])
    assert started and capsys.readouterr().out.splitlines() == [first_build_notice()]

    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed, "init_distributed", lambda *a, **k: started.append("group"))
    distributed.init_single_process()
    assert started[-1] == "group" and capsys.readouterr().out.splitlines() == [first_build_notice()]
