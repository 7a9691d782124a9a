#!/usr/bin/env bash
# The savings study of benchmarks/JOURNAL.md: every point of its grid, resumable across sessions.
#
#   bash benchmarks/run_study.sh            # the points marked "default" in benchmarks/ORDER, in order
#   bash benchmarks/run_study.sh cpu-8x256-480 cpu-4x128-3840    # some points
#   bash benchmarks/run_study.sh --list     # every point's runs, in the order of benchmarks/ORDER
#   bash benchmarks/run_study.sh --seeds 2 cpu-8x256-480     # only the first two seeds of a point
#   bash benchmarks/run_study.sh ablation-8x256-480          # the recipe's ablation (one seed)
#
# A point is a folder benchmarks/<point>/ holding a file `lines`: its size flags on the first line
# (e.g. `--size cpu-4x64 --steps 18800`), then `seeds N`, then one line of benchmark flags per row
# (tools/benchmark_savings.py). A row marked `once: ` runs with the first seed only (a sweep), one
# marked `later: ` with the seeds after the first only. `#` starts a comment; blank lines are skipped.
#
# All runs of a point are made by the code of one commit, benchmarks/STUDY_COMMIT (the scale study's
# pin), or benchmarks/<point>/STUDY_COMMIT where a point has its own (the ablation of a later
# recipe): the script runs the benchmark from a worktree of that commit, whatever main has become
# since, so a study continued by a later session on another machine never mixes code versions. Each finished run
# leaves a small JSON file in benchmarks/<point>/runs/ (commit them); a later call skips those and
# runs only what is missing, then remakes benchmarks/<point>/results.{json,md} and the plots.
# Killed in the middle, a run resumes from its last checkpoint (run directories: runs/study/).
# A point with its own data has a script benchmarks/<point>/prepare (called with the worktree and
# the Python to use), which prepares it under the data cache once, before the point's first run.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python_bin="${PYTHON:-python}"

points_of() {  # the points of benchmarks/ORDER; with an argument, only those marked with it
  sed 's/#.*//' "$root/benchmarks/ORDER" | awk -v mark="${1:-}" 'NF && (mark == "" || $2 == mark) {print $1}'
}

read_point() {  # sets size, seeds and rows from benchmarks/$1/lines
  local file="$root/benchmarks/$1/lines" line
  size="" seeds="" rows=()
  while IFS= read -r line || [[ -n "$line" ]]; do
    line="${line%%#*}"                       # a comment
    line="${line#"${line%%[![:space:]]*}"}"  # blanks before
    line="${line%"${line##*[![:space:]]}"}"  # and after
    if [[ -z "$line" ]]; then continue
    elif [[ -z "$size" ]]; then size="$line"
    elif [[ -z "$seeds" ]]; then
      [[ "$line" =~ ^seeds\ +([0-9]+)$ ]] \
        || { echo "run_study.sh: $file: 'seeds N' must follow the size line" >&2; exit 2; }
      seeds="${BASH_REMATCH[1]}"
    else rows+=("$line"); fi
  done < "$file"
  [[ -n "$seeds" ]] || { echo "run_study.sh: $file: a size line and a 'seeds N' line are needed" >&2; exit 2; }
}

max_seeds=""
if [[ "${1:-}" == "--seeds" ]]; then
  max_seeds="${2:?--seeds takes a number}"; shift 2
fi
if [[ "${1:-}" == "--list" ]]; then
  for point in $(points_of); do
    read_point "$point"
    for row in "${rows[@]}"; do
      echo "$point: $size $row (seeds 1234 to $((1233 + seeds)))"
    done
  done
  exit 0
fi
points=("$@")
[[ ${#points[@]} -gt 0 ]] || mapfile -t points < <(points_of default)
for point in "${points[@]}"; do
  [[ "$point" =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ && -f "$root/benchmarks/$point/lines" ]] \
    || { echo "run_study.sh: unknown point $point (see --list)" >&2; exit 2; }
  read_point "$point"
done

pin_of() {  # the commit whose code makes a point's runs: the point's own pin, else the study's
  local own="$root/benchmarks/$1/STUDY_COMMIT"
  if [[ -f "$own" ]]; then cat "$own"; else cat "$root/benchmarks/STUDY_COMMIT"; fi
}
for point in "${points[@]}"; do
  if [[ ! -f "$root/benchmarks/$point/STUDY_COMMIT" && ! -f "$root/benchmarks/STUDY_COMMIT" ]]; then
    echo "run_study.sh: benchmarks/STUDY_COMMIT names the commit whose code makes every run of the study;" >&2
    echo "  pin it once, before the first run: git rev-parse HEAD > benchmarks/STUDY_COMMIT (and commit it)" >&2
    exit 2
  fi
done

worktree_of() {  # sets work: a worktree of the commit $1, sharing main's data cache (corpus, tokenizer)
  work="$root/.cache/study-${1:0:12}"
  if [[ ! -d "$work" ]]; then
    git -C "$root" worktree add --detach "$work" "$1" >/dev/null
  fi
  mkdir -p "$root/.cache/megatron_multilevel" "$work/.cache"
  ln -sfn "$root/.cache/megatron_multilevel" "$work/.cache/megatron_multilevel"
}

run_row() {  # run_row POINT COMMIT WORK SEED ROW: one benchmark call, tried three times
  local point=$1 commit=$2 work=$3 seed=$4 row=$5 attempt
  # a run that fails (a port taken at its rendezvous by another job on the machine) is tried
  # again, twice: the benchmark runs only what is missing and resumes from the last checkpoint
  # (run directories per pin: a run never resumes from another code's checkpoint)
  for attempt in 1 2 3; do
    # shellcheck disable=SC2086
    if (cd "$work" && "$python_bin" tools/benchmark_savings.py $size $row \
        --seed "$seed" --results "$root/benchmarks/$point" --out "$root/runs/study/$point-${commit:0:12}"); then
      return 0
    fi
    [[ $attempt -lt 3 ]] || { echo "run_study.sh: $point, seed $seed: failed 3 times" >&2; exit 1; }
    echo "run_study.sh: $point, seed $seed: failed, trying again ($((attempt + 1))/3)"
  done
}

export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$root/.cache/torch_extensions}"
for point in "${points[@]}"; do
  commit="$(pin_of "$point")"
  worktree_of "$commit"
  echo "== $point (code of $commit)"
  read_point "$point"
  if [[ -f "$root/benchmarks/$point/prepare" ]]; then  # the point's own data, prepared once by its pin's tools
    bash "$root/benchmarks/$point/prepare" "$work" "$python_bin"
  fi
  [[ -z "$max_seeds" || $max_seeds -ge $seeds ]] || seeds=$max_seeds
  # seed by seed, every method at every fraction: a study stopped early has whole seeds
  for ((s = 0; s < seeds; s++)); do
    for row in "${rows[@]}"; do  # each row adds its method; the last report shows them all
      if [[ "$row" == "once: "* ]]; then  # a sweep: the first seed only
        [[ $s -eq 0 ]] || continue
        row="${row#once: }"
      elif [[ "$row" == "later: "* ]]; then  # the seeds after the first only
        [[ $s -gt 0 ]] || continue
        row="${row#later: }"
      fi
      run_row "$point" "$commit" "$work" $((1234 + s)) "$row"
    done
  done
done
