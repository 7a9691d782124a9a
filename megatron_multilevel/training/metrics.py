"""What a run shows and keeps: console progress, ``metrics.jsonl``, TensorBoard events.

Only global rank 0 writes. Every record carries the level, phase, global step, tokens, FLOPs
and wall-clock seconds so far (training and transitions, not evaluation or checkpointing), so
that loss can be plotted against any of them (``tools/plot_metrics.py``).
"""

import json
import os
import time
from typing import Optional

from megatron_multilevel.records import METRICS_FILE


def _hms(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Metrics:
    def __init__(self, output_dir: str, *, enabled: bool, resume_global_step: Optional[int] = None,
                 resume_phase: Optional[int] = None):
        self.enabled = enabled
        self.path = os.path.join(output_dir, METRICS_FILE)
        self.started = time.time()
        self.tb = None
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        if resume_global_step is not None and os.path.exists(self.path):
            self._truncate_after(resume_global_step, resume_phase)
        elif resume_global_step is None and os.path.exists(self.path):
            os.remove(self.path)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(output_dir, "tensorboard"), purge_step=resume_global_step)
        except ImportError:  # tensorboard is optional at run time
            self.tb = None

    def _truncate_after(self, global_step: int, phase: Optional[int]) -> None:
        """Drop what a killed run logged after the checkpoint it resumes from: later steps, and at its
        step the records of later phases (a checkpoint at a phase's end, resumed after the next
        phase had begun)."""
        def before(record: dict) -> bool:
            step = record.get("global_step", 0)
            later_phase = phase is not None and record.get("phase", phase) > phase
            return step < global_step or (step == global_step and not later_phase)

        with open(self.path) as f:
            kept = [line for line in f if line.strip() and before(json.loads(line))]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)

    def record(self, kind: str, **values) -> None:
        if not self.enabled:
            return
        values = {"type": kind, **values}
        with open(self.path, "a") as f:
            f.write(json.dumps(values) + "\n")
        if self.tb is not None and "global_step" in values:
            for key in ("loss", "lr", "tokens_per_s", "level"):
                if key in values:
                    self.tb.add_scalar(f"{kind}/{key}", values[key], values["global_step"])
            if kind == "valid":
                self.tb.add_scalar("valid/loss_vs_gflops", values["loss"], int(values["flops"] / 1e9))
            self.tb.flush()

    def progress(self, *, level: int, phase: int, num_phases: int, step: int, steps: int, global_step: int,
                 total_steps: int, loss: float, lr: float, tokens_per_s: float, elapsed: float, eta: float,
                 compute: float) -> None:
        """One console line; ``compute`` is the FLOPs so far over what the fine model alone would
        have spent on the same tokens."""
        if not self.enabled:
            return
        print(
            f"[level {level} | phase {phase + 1}/{num_phases} | step {step}/{steps} | "
            f"global {global_step}/{total_steps}] loss {loss:.4f} | lr {lr:.2e} | "
            f"{tokens_per_s / 1000:.1f}k tok/s | compute {compute:.0%} of fine-only | "
            f"elapsed {_hms(elapsed)} | eta {_hms(eta)}",
            flush=True,
        )

    def say(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
