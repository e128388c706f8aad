#!/usr/bin/env bash
# Parallel-save benchmark for 1, 2 and 4 ranks (bench/bench_parallel.py), each launch under
# `timeout` with `python -m mpi4py` (a rank that fails aborts the whole job instead of hanging),
# then the launches combined into bench/results/parallel.json and parallel.md.
#
#   bench/run_parallel.sh                    # full run: 1 GiB float32 per rank, 7 timed reps
#   RANKS="2" bench/run_parallel.sh --reps 7 # other rank counts; arguments go to every launch
#   TIMEOUT=600 OUT=/tmp/p.json bench/run_parallel.sh --size-gib 0.25
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
mpiexec=${MPIEXEC:-$(dirname "$py")/mpiexec}
ranks=${RANKS:-1 2 4}
limit=${TIMEOUT:-300}  # seconds per launch
out=${OUT:-bench/results/parallel.json}
parts=$(mktemp -d)
trap 'rm -rf "$parts"' EXIT

for n in $ranks; do
  echo "## $n rank(s)"
  timeout -k 5 "$limit" "$mpiexec" -n "$n" "$py" -m mpi4py bench/bench_parallel.py \
    --part "$parts/r$n.json" "$@"
done
"$py" bench/bench_parallel.py --combine "$parts"/r*.json --out "$out"
