"""A build lock of torch's JIT extensions left by a killed process does not hang later runs."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_multilevel.distributed import STALE_LOCK_SECONDS, clear_stale_extension_locks

ROOT = Path(__file__).resolve().parents[1]


def _plant(path: Path, age: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    then = time.time() - age
    os.utime(path, (then, then))


def test_only_stale_locks_are_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale, fresh = tmp_path / "op_a" / "lock", tmp_path / "op_b" / "lock"
    _plant(stale, STALE_LOCK_SECONDS + 60)
    _plant(fresh, 5)  # a process is loading or building op_b right now
    assert clear_stale_extension_locks() == [str(stale)]
    assert not stale.exists() and fresh.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="DeepSpeed builds its CPU communication op only on CPU")
def test_a_process_starts_despite_a_lock_left_by_a_killed_one():
    extensions = Path(os.environ.get("TORCH_EXTENSIONS_DIR", ROOT / ".cache" / "torch_extensions"))
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions)}
    start = [sys.executable, "-c", "from megatron_multilevel.distributed import init_single_process as f; f()"]
    subprocess.run(start, env=env, check=True, timeout=600, cwd=ROOT)  # builds the op if needed
    lock = extensions / "deepspeed_shm_comm" / "lock"
    assert lock.parent.is_dir()
    _plant(lock, STALE_LOCK_SECONDS + 60)
    result = subprocess.run(start, env=env, timeout=120, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert not lock.exists()
    assert "a build lock left by a killed process" in result.stderr
