"""The benchmark's kept runs: the code version a run is made by (:func:`source_version`), and the
run files of one code version (:func:`kept_runs`).
"""

import os

# The package's folders of report-only code (not run by training), left out of the code version.
REPORT_ONLY = ("study",)


def source_version(root: str) -> str:
    """A short hash of the code a run executes (the package and the launcher), so that figures
    made by different code are never put in one table. The study's code (this folder,
    ``study/``: the savings arithmetic, the compared methods' configs, this bookkeeping and the
    plots) is not run by training and is left out: a change to a report does not make the runs
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
    import json

    runs = []
    for path in sorted(glob.glob(os.path.join(runs_dir, "*.json"))):
        with open(path) as f:
            runs.append(json.load(f))
    return [r for r in runs if r["version"] == version], sorted({r["version"] for r in runs} - {version})
