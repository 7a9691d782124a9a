"""Experiment trackers through DeepSpeed's monitor config: a run with Weights & Biases (offline) and
the CSV monitor enabled writes to each of them the scalars it writes to TensorBoard."""

import csv
import json
from pathlib import Path

import pytest

from launch_helpers import launch, ok, run_config

wandb = pytest.importorskip("wandb")


def _tensorboard(directory: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {(tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}


def _csv(directory: Path) -> dict:
    out = {}
    for path in directory.glob("*.csv"):
        with open(path) as f:
            rows = list(csv.reader(f))
        for step, value in rows[1:]:  # after the header
            out[(path.stem, int(step))] = float(value)
    return out


def _wandb_records(path: Path):
    """The records of a W&B transaction log (``run-<id>.wandb``: a header, then records in 32 KiB
    blocks, each chunk with a 7-byte header: CRC, length, type (1 full, 2 first, 3 middle, 4 last))."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room left in the block for a header: padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _wandb(directory: Path) -> dict:
    (log,) = directory.glob("wandb/offline-run-*/run-*.wandb")
    out = {}
    for record in _wandb_records(log):
        if record.WhichOneof("record_type") == "history":
            step = record.history.step.num
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    out[(key, step)] = float(json.loads(item.value_json))
    return out


def test_wandb_offline_and_csv_hold_the_tensorboard_scalars(corpus, tmp_path, monkeypatch):
    config = run_config(tmp_path, corpus, "run", wandb={"enabled": True, "project": "multilevel-test"},
                        csv_monitor={"enabled": True})
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    ok(launch(config, env=env))
    run = tmp_path / "run"
    board = {k: v for k, v in _tensorboard(run / "tensorboard").items() if k[0] != "valid/loss_vs_gflops"}
    assert {"train/loss", "valid/loss", "transition/loss_before", "transition/jump"} <= {tag for tag, _ in board}
    sheets = _csv(run / "csv")
    assert {(tag.replace("/", "_"), step) for tag, step in board} == set(sheets)
    logged = _wandb(run)
    assert set(board) == set(logged)
    for (tag, step), value in board.items():  # TensorBoard keeps float32
        assert sheets[(tag.replace("/", "_"), step)] == pytest.approx(value, rel=1e-6), (tag, step)
        assert logged[(tag, step)] == pytest.approx(value, rel=1e-6), (tag, step)
    assert (run / "wandb_run_id").read_text() in next((run / "wandb").glob("offline-run-*")).name


def test_the_launcher_turns_wandb_on(corpus, tmp_path):
    """``--wandb-project`` (and ``--wandb-group``) set the config's W&B block, as Megatron-LM's flags do."""
    config = run_config(tmp_path, corpus, "run")
    result = ok(launch(config, "--wandb-project", "multilevel-test", "--wandb-group", "g1",
                       env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"}))
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["wandb"] == {"enabled": True, "project": "multilevel-test", "group": "g1"}, result.stdout[-2000:]
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
