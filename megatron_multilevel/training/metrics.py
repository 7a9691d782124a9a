"""What a run shows and keeps: console progress, ``metrics.jsonl``, TensorBoard events, and
DeepSpeed's monitors where the config enables them (Weights & Biases, CSV, Comet, its TensorBoard).

Only global rank 0 writes. Every record carries the level, phase, global step, tokens, FLOPs
and wall-clock seconds so far (training and transitions, not evaluation or checkpointing), so
that loss can be plotted against any of them (``tools/plot_metrics.py``). The scalars of a record
(:func:`scalars`) go to TensorBoard and to every monitor under the same names, at the global step.
"""

import json
import os
import time
from typing import Optional

from megatron_multilevel.records import METRICS_FILE

# The scalars of a record, by the record's type: ``<type>/<key>`` at its global step.
SCALARS = ("loss", "lr", "tokens_per_s", "level", "loss_before", "loss_after", "jump")


def scalars(kind: str, values: dict) -> list[tuple[str, float, int]]:
    """``(name, value, global step)`` of each scalar of a record (none without a global step)."""
    if "global_step" not in values:
        return []
    step = values["global_step"]
    out = [(f"{kind}/{key}", float(values[key]), step) for key in SCALARS if values.get(key) is not None]
    if kind == "valid":
        out.append(("valid/loss_vs_gflops", float(values["loss"]), int(values["flops"] / 1e9)))
    return out


def deepspeed_monitor(blocks: dict, output_dir: str):
    """DeepSpeed's ``MonitorMaster`` for the config's monitor ``blocks`` (None if none is enabled).
    Where a block leaves it open, the files go into the run directory (CSV in ``<run>/csv``,
    DeepSpeed's TensorBoard in ``<run>/tensorboard/deepspeed``, W&B's run in ``<run>/wandb``), and
    a resumed run continues the same W&B run (its id kept in ``<run>/wandb_run_id``)."""
    blocks = {k: dict(v) for k, v in blocks.items() if isinstance(v, dict) and v.get("enabled")}
    if not blocks:
        return None
    from deepspeed.monitor.config import get_monitor_config
    from deepspeed.monitor.monitor import MonitorMaster

    where = {"csv_monitor": "csv", "tensorboard": os.path.join("tensorboard", "deepspeed")}
    for name, sub in where.items():
        if name in blocks:
            blocks[name].setdefault("output_path", os.path.join(output_dir, sub))
            blocks[name].setdefault("job_name", "")
    if "wandb" in blocks:
        os.environ.setdefault("WANDB_DIR", output_dir)
        id_file = os.path.join(output_dir, "wandb_run_id")
        if not os.path.exists(id_file):
            with open(id_file, "w") as f:
                f.write(os.urandom(6).hex())
        with open(id_file) as f:
            os.environ.setdefault("WANDB_RUN_ID", f.read().strip())
        os.environ.setdefault("WANDB_RESUME", "allow")
    return MonitorMaster(get_monitor_config(blocks))


def _hms(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Metrics:
    def __init__(self, output_dir: str, *, enabled: bool, resume_global_step: Optional[int] = None,
                 resume_phase: Optional[int] = None, monitors: Optional[dict] = None):
        self.enabled = enabled
        self.path = os.path.join(output_dir, METRICS_FILE)
        self.started = time.time()
        self.tb = self.monitor = None
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
        self.monitor = deepspeed_monitor(monitors or {}, output_dir)

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
        events = scalars(kind, values)
        if self.tb is not None and events:
            for name, value, step in events:
                self.tb.add_scalar(name, value, step)
            self.tb.flush()
        if self.monitor is not None and events:  # at global steps only (W&B's steps only go up)
            self.monitor.write_events([e for e in events if e[0] != "valid/loss_vs_gflops"])

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
        if self.monitor is not None and self.monitor.wandb_monitor is not None:
            import wandb

            wandb.finish()
