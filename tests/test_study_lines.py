"""The study as data: every point's ``benchmarks/<point>/lines`` reads, its rows are flags the benchmark
accepts, ``run_study.sh --list`` shows exactly those points and rows, and the committed records carry
no path of the machine they were made on."""

import re
import subprocess

import pytest

from launch_helpers import ROOT, load_tool

BENCHMARKS = ROOT / "benchmarks"
LINES = sorted(BENCHMARKS.glob("*/lines"))
PREFIXES = ("once: ", "later: ")  # the first seed only; the seeds after the first only


def read_lines(path) -> tuple[str, int, list[str]]:
    """The size flags, the seed count and the rows of a ``lines`` file, as ``run_study.sh`` reads them."""
    lines = [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()]
    size, seeds, *rows = [line for line in lines if line]
    match = re.fullmatch(r"seeds +(\d+)", seeds)
    assert match, f"{path}: the line after the size flags is 'seeds N', got {seeds!r}"
    return size, int(match[1]), rows


def _benchmark():
    return load_tool("benchmark_savings")


def test_there_are_points():
    assert len(LINES) >= 20


@pytest.mark.parametrize("path", LINES, ids=[p.parent.name for p in LINES])
def test_every_row_is_accepted_by_the_benchmark(path):
    benchmark = _benchmark()
    size, seeds, rows = read_lines(path)
    assert size.startswith("--size ") and seeds >= 1 and rows
    for row in rows:
        flags = row.removeprefix(PREFIXES[0]).removeprefix(PREFIXES[1])
        assert not flags.startswith(("once:", "later:")), f"{path}: {row!r}"
        argv = size.split() + flags.split() + ["--seed", "1234", "--results", "r", "--out", "o"]
        try:
            benchmark.parse_args(benchmark.build_parser(), argv)
        except SystemExit:
            pytest.fail(f"{path}: tools/benchmark_savings.py refuses {size} {flags}")


def test_list_names_only_points_with_lines_and_their_rows():
    listed = subprocess.run(["bash", str(BENCHMARKS / "run_study.sh"), "--list"], capture_output=True, text=True,
                            check=True).stdout.splitlines()
    expected = []
    order = [line.split()[0] for line in (BENCHMARKS / "ORDER").read_text().splitlines()
             if line.split("#", 1)[0].strip()]
    assert sorted(order) == sorted(p.parent.name for p in LINES), "benchmarks/ORDER names every point once"
    for point in order:
        size, seeds, rows = read_lines(BENCHMARKS / point / "lines")
        expected += [f"{point}: {size} {row} (seeds 1234 to {1233 + seeds})" for row in rows]
    assert listed == expected
    assert {line.split(":")[0] for line in listed} <= {p.parent.name for p in LINES}


def test_the_benchmark_records_paths_relative_to_the_repository():
    benchmark = _benchmark()
    root = benchmark.ROOT
    assert benchmark.repo_relative(f"{root}/benchmarks/cpu-8x256-480") == "benchmarks/cpu-8x256-480"
    assert benchmark.repo_relative(f"--out={root}/runs/study/x") == "--out=runs/study/x"
    assert benchmark.repo_relative(f"{root}/.cache/megatron_multilevel") == ".cache/megatron_multilevel"
    assert [benchmark.repo_relative(a) for a in ("--size", "cpu", "0.5", f"{root}-other/x")] == [
        "--size", "cpu", "0.5", f"{root}-other/x"]


MACHINE_PATH = re.compile(r"(?<![\w.~/-])/(work|tmp|root|home|Users)/")


def test_committed_records_carry_no_machine_paths():
    tracked = subprocess.run(["git", "ls-files", "benchmarks", "docs"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    hits = []
    for name in tracked:
        path = ROOT / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:  # a plot
            continue
        hits += [f"{name}:{i}: {line.strip()[:120]}" for i, line in
                 enumerate(data.decode(errors="replace").splitlines(), 1) if MACHINE_PATH.search(line)]
    assert not hits, "paths of the machine a record was made on:\n" + "\n".join(hits[:20])
