"""The GPU validation script's dry run: what CI can check of it without a GPU."""

import importlib.metadata
import json
import os
import subprocess
import sys

import torch

from launch_helpers import ROOT


def test_gpu_check_dry_run(tmp_path):
    # The script runs on the interpreter under test (its PYTHON), not on whichever `python` is on the
    # PATH: that one can be another Python version, which would also compile DeepSpeed's ops into
    # this interpreter's TORCH_EXTENSIONS_DIR.
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--dry-run", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["environment"]["megatron-core"] == importlib.metadata.version("megatron-core")
    assert report["environment"]["torch"] == torch.__version__
    fp32 = report["logit_differences"]["fp32"]
    assert fp32["max_abs_logit"] > 0.1 and fp32["max_abs_diff"] < 1e-5  # width de-coalescing is exact
    assert report["logit_differences"]["bf16"]["max_abs_diff"] < 0.05
    phases = report["vcycle"]["phases"]
    assert [p["level"] for p in phases] == [0, 1, 0] and [p["shape"] for p in phases] == ["4x64", "2x32", "4x64"]
    assert all(p["tokens_per_s"] > 0 for p in phases) and phases[1]["transition_seconds"] > 0
    assert "| phase | level | shape | tokens/s |" in result.stdout
