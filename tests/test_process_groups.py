"""A run destroys its process groups before it exits: gloo's worker threads left to the interpreter's
teardown abort a rank now and then after a finished run (exit -6)."""

import subprocess
import sys
import warnings

import pytest
import torch

from launch_helpers import ROOT


def test_shutdown_destroys_megatrons_groups_and_the_process_group():
    code = ("import torch.distributed as dist\n"
            "from megatron.core import parallel_state\n"
            "from megatron_multilevel.distributed import init_single_process, shutdown_distributed\n"
            "init_single_process()\n"
            "assert dist.is_initialized() and parallel_state.model_parallel_is_initialized()\n"
            "shutdown_distributed()\n"
            "shutdown_distributed()  # a second call finds nothing to destroy\n"
            "print(dist.is_initialized(), parallel_state.model_parallel_is_initialized())\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-1].split() == ["False", "False"]


@pytest.mark.parametrize("fails", [False, True])
def test_a_run_shuts_its_groups_down_whether_it_ends_or_fails(monkeypatch, tmp_path, fails):
    """pretrain.main destroys the groups after the run, and after a run that stops with an error."""
    import megatron_multilevel.distributed as distributed
    import megatron_multilevel.pretrain as pretrain
    import megatron_multilevel.training.run_lock as run_lock
    import megatron_multilevel.training.trainer as trainer

    calls = []

    class Trainer:
        def __init__(self, cfg, *args, **kwargs):
            pass

        def run(self):
            calls.append("run")
            if fails:
                raise trainer.TrainingError("the loss is not finite")

    class Lock:
        def release(self):
            calls.append("unlock")

    # no process group in this process (the tests that run here share it): what main asks of one, stubbed
    monkeypatch.setattr(distributed, "init_distributed", lambda *a, **k: calls.append("init"))
    monkeypatch.setattr(distributed, "shutdown_distributed", lambda: calls.append("shutdown"))
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 1)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(run_lock, "hold_run_directory", lambda *a, **k: Lock())
    monkeypatch.setattr(trainer, "Trainer", Trainer)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with warnings.catch_warnings():
        code = pretrain.main(["--config", str(ROOT / "configs" / "gpt_tiny_cpu.json"), "--no-baseline",
                             f"training.output_dir={tmp_path}"])
    assert code == (1 if fails else 0)
    assert calls[:2] == ["init", "run"] and sorted(calls[2:]) == ["shutdown", "unlock"]
