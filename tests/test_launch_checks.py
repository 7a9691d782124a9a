"""Errors before launch: the launcher checks the config and its overrides as the ranks will, and its
own environment, before the DeepSpeed launcher starts anything; a mistake is one line and a non-zero
exit."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_multilevel.config import load_config

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = ROOT / "launch" / "pretrain_vcycle.sh"
TINY = ROOT / "configs" / "gpt_tiny_cpu.json"
# what the DeepSpeed launcher prints once it runs, at the log level the launcher is asked for below
LAUNCHER_LINES = ("runner.py", "launch.py", "[INFO]", "world_info", "DeepSpeed")


def run_launcher(*args, python: str = sys.executable) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": python}
    return subprocess.run(["bash", str(LAUNCHER), *map(str, args), "--launcher-log-level", "info"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def assert_one_line_before_launch(result: subprocess.CompletedProcess, *expected: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert len(output.strip().splitlines()) == 1, output
    assert all(text in output for text in expected), output
    assert not any(line in output for line in LAUNCHER_LINES), output


def test_a_misspelt_key_gets_did_you_mean():
    """The closest valid key is named after the list of valid keys, per key where several are unknown."""
    with pytest.raises(ValueError, match=r"config.model: unknown key\(s\) \['hiden_size'\]; valid keys are \[.*"
                                         r"'vocab_size'\]; did you mean 'hidden_size'\?$"):
        load_config({"model": {"hiden_size": 64}})
    with pytest.raises(ValueError, match=r"did you mean 'hidden_size' for 'hiden_size', 'num_layers' for "
                                         r"'num_layer'\?$"):
        load_config({"model": {"hiden_size": 64, "num_layer": 2, "xyzzy": 1}})
    with pytest.raises(ValueError, match=r"valid keys are \[[^]]*\]$"):  # nothing close: no guess
        load_config({"model": {"xyzzy": 1}})


def test_a_bad_config_stops_the_launcher_before_deepspeed(tmp_path):
    config = tmp_path / "bad.json"
    config.write_text(TINY.read_text().replace('"hidden_size"', '"hiden_size"'))
    result = run_launcher(config)
    assert_one_line_before_launch(result, "error: config.model: unknown key(s) ['hiden_size']",
                                  "did you mean 'hidden_size'?")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a machine without a GPU refuses FP8")
def test_fp8_without_transformer_engine_stops_the_launcher_before_deepspeed():
    result = run_launcher(TINY, "model.fp8=hybrid")
    assert_one_line_before_launch(result, "error: model.fp8 = 'hybrid' needs the Transformer Engine layers on a GPU")


def test_a_bad_override_stops_the_launcher_before_deepspeed():
    result = run_launcher(TINY, "training.train_steps=many")
    assert_one_line_before_launch(result, "error: config.training.train_steps: expected an integer, got 'many'")
    # a list item that is not there: one line naming the valid indices, not an IndexError's traceback
    result = run_launcher(TINY, "multilevel.levels.2.steps_before=4")
    assert_one_line_before_launch(result, "error: override 'multilevel.levels.2.steps_before=4': '2' is not an "
                                          "index of a list of 2 item(s); valid indices are [0, 1]")
    result = run_launcher(TINY, "multilevel.levels.last.steps_before=4")
    assert_one_line_before_launch(result, "'last' is not an index of a list of 2 item(s)")


def test_the_check_takes_the_ranks_arguments():
    """--with-baseline is checked as the ranks check it; a valid config passes in silence, and its
    learning-rate warning is one line."""
    result = run_launcher(TINY, "multilevel.enabled=false", "--with-baseline")
    assert_one_line_before_launch(result, "--with-baseline", "multilevel.enabled is false")
    check = [sys.executable, "-m", "megatron_multilevel.pretrain", "--check", "--config", str(TINY)]
    quiet = subprocess.run(check, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "", "")
    warned = subprocess.run([*check, "optimizer.params.lr=0.01"], capture_output=True, text=True, cwd=ROOT,
                            timeout=120)
    assert warned.returncode == 0 and warned.stdout == "", warned.stderr
    assert warned.stderr.splitlines() == [
        "warning: optimizer.params.lr = 0.01 is not used by a multilevel run: the full model's first phase "
        "trains at 0.001 (its level's schedule; each level has its own)"]


def test_the_learning_rate_warning_is_one_line():
    """Wherever the config is loaded (a rank, a tool), not only by the launcher's check."""
    code = ("from megatron_multilevel.config import load_config\n"
            "load_config({'optimizer': {'type': 'AdamW', 'params': {'lr': 0.5}}, 'multilevel': {'enabled': True, "
            "'levels': [{'steps_before': 2, 'lr_before': {'peak': 0.002}, 'steps_after': 2}, {'steps_before': 2}]}})")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0 and result.stderr.splitlines() == [
        "warning: optimizer.params.lr = 0.5 is not used by a multilevel run: the full model's first phase trains "
        "at 0.002 (its level's schedule; each level has its own)"], result.stderr


def test_a_python_without_deepspeed_is_told_how_to_set_up(tmp_path):
    bare = tmp_path / "python"  # this interpreter without its site-packages
    bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    bare.chmod(0o755)
    result = run_launcher(TINY, python=str(bare))
    assert_one_line_before_launch(result, "cannot import deepspeed", "source .venv/bin/activate", "make setup")
    assert "No module named" not in result.stderr
