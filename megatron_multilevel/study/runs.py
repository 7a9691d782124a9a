"""The benchmark's kept runs: the code version a run is made by (:func:`source_version`) and the
commit it was made from (:func:`source_commit`), the small record of a finished run that is kept
(:func:`run_result`, written by :func:`write_json`), whether a kept run can be reused
(:func:`reusable`), the run files of one code version (:func:`kept_runs`), and the one sample
order every run of a table reads a prefix of (:func:`table_order`).
"""

import json
import os
import subprocess

from megatron_multilevel.records import read_metrics, read_summary

# The package's folders of report-only code (not run by training), left out of the code version.
REPORT_ONLY = ("study",)


def source_version(root: str) -> str:
    """A short hash of the code a run executes (the package and the launcher), so that figures
    made by different code are never put in one table. The study's code (this folder,
    ``study/``: the savings arithmetic and report, the compared methods' configs and sizes, this
    bookkeeping and the plots) is not run by training and is left out: a change to a report does not make the runs
    under it stale."""
    import hashlib

    digest = hashlib.sha256()
    files = [os.path.join(root, "launch", "pretrain_vcycle.sh")]
    package = os.path.join(root, "megatron_multilevel")
    report_only = {os.path.join(package, d) for d in REPORT_ONLY}
    for dirpath, dirnames, filenames in os.walk(package):
        dirnames[:] = sorted(d for d in dirnames
                             if d != "__pycache__" and os.path.join(dirpath, d) not in report_only)
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    for path in files:
        digest.update(os.path.relpath(path, root).encode())
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:12]


def kept_runs(runs_dir: str, version: str) -> tuple[list[dict], list[str]]:
    """The result files of ``runs_dir`` (one JSON file per finished run) made by the code
    ``version`` (:func:`source_version`), in file-name order, and the other code versions found
    there: those are left out, so that a table never mixes code versions."""
    import glob

    runs = []
    for path in sorted(glob.glob(os.path.join(runs_dir, "*.json"))):
        with open(path) as f:
            runs.append(json.load(f))
    return [r for r in runs if r["version"] == version], sorted({r["version"] for r in runs} - {version})


def table_order(configs: dict[str, dict], kept: list[dict], given: "int | None", *, where: str) -> int:
    """``data.order_samples`` of every run of a table, so that training from scratch and every method
    at every budget fraction read prefixes of one sample order: ``given`` (``--order-samples``), else
    the kept runs' (``kept``: the table's runs of this code version, in ``where``), else the training
    samples of the longest run at the full budget (``configs``: each method's uncompressed config).
    A ``ValueError`` where that is fewer samples than the longest run reads, or where the kept runs
    read another order (the table would mix two)."""
    from megatron_multilevel.config import load_config

    longest = 0
    for config in configs.values():
        cfg = load_config(config)
        assert "train_batch_size" in cfg.deepspeed, "the benchmark's configs set the global batch"
        ml = cfg.multilevel  # a run's steps: its phases' (training.schedule.build_phases makes one of each spec)
        steps = sum(spec.steps for spec in ml.phase_specs()) if ml.enabled else cfg.training.train_steps
        longest = max(longest, steps * int(cfg.deepspeed["train_batch_size"]))
    orders = sorted({r["config"].get("data", {}).get("order_samples") for r in kept}, key=str)
    order = given if given is not None else orders[0] if len(orders) == 1 else longest
    if order is None or order < longest:
        source = "--order-samples" if given is not None else f"the kept runs in {where}"
        raise ValueError(f"{source}: an order of {order} samples is fewer than the {longest} training samples of "
                         f"the longest run; give --order-samples {longest} or more (a new table: another --results)")
    if orders and orders != [order]:
        raise ValueError(f"the kept runs in {where} read an order of {' and '.join(map(str, orders))} samples, this "
                         f"call's of {order}: a table reads one order; give --order-samples as they do, or another "
                         f"--results for a new table")
    return order


def source_commit(root: str) -> str:
    """The git commit of the checkout at ``root``, ``+uncommitted`` where its package or launcher
    have changes not committed (``unknown`` outside a git checkout)."""
    result = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=root)
    dirty = subprocess.run(["git", "status", "--porcelain", "megatron_multilevel", "launch"], capture_output=True,
                           text=True, cwd=root).stdout.strip()
    return (result.stdout.strip() or "unknown") + ("+uncommitted" if dirty else "")


def run_result(run_dir: str, *, method: str, fraction: float, seed: int, version: str, commit: str,
               config: dict) -> dict:
    """The small record of one finished run that is kept (and committed) with the benchmark."""
    summary = read_summary(run_dir)
    config = json.loads(json.dumps(config))
    config["training"].pop("output_dir")
    valid = [{k: r[k] for k in ("level", "phase", "global_step", "loss", "tokens", "flops", "seconds")}
             for r in read_metrics(run_dir) if r.get("type") == "valid"]
    phases = [{k: p[k] for k in ("phase", "name", "level", "steps", "model", "flops", "valid_loss")}
              for p in summary["phases"]]
    return {"method": method, "fraction": fraction, "seed": seed, "version": version, "commit": commit,
            "config": config, "valid": valid, "phases": phases, "totals": summary["totals"]}


def reusable(path: str, version: str, config: dict) -> bool:
    """A kept result of the same run by the same code."""
    if not os.path.exists(path):
        return False
    with open(path) as f:
        kept = json.load(f)
    # where a run writes and where its prepared data are cached are places, not settings: a run
    # made from another checkout of the same code, on the same data, is the same run
    config, kept_config = json.loads(json.dumps(config)), json.loads(json.dumps(kept["config"]))
    for cfg in (config, kept_config):
        cfg["training"].pop("output_dir", None)
        cfg.get("data", {}).pop("cache_dir", None)
    return kept["version"] == version and kept_config == config


def write_json(path: str, value) -> None:
    """``value`` as JSON at ``path``, written whole or not at all (through a temporary file)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
    os.replace(tmp, path)
