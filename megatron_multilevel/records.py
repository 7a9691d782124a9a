"""A run directory's files as they are read back: its metric records and its summary.

Ground floor (standard library only), so that the trainer, which writes them, and the study and the
tools, which read them, share the names without importing one another.
"""

import json
import os

METRICS_FILE = "metrics.jsonl"
"""One JSON record per line: ``train``, ``valid``, ``resume`` and the transitions' records."""
SUMMARY = "summary.json"
"""The finished run's phases and totals (and, with a baseline, the comparison)."""


def read_metrics(run_dir: str) -> list[dict]:
    """The records a run wrote, in order."""
    with open(os.path.join(run_dir, METRICS_FILE)) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_summary(run_dir: str) -> dict:
    """The summary a finished run wrote."""
    with open(os.path.join(run_dir, SUMMARY)) as f:
        return json.load(f)
