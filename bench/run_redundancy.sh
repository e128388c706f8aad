#!/usr/bin/env bash
# Redundancy benchmark (bench/bench_redundancy.py): one launch of 8 ranks, one per simulated node,
# under `timeout` with `python -m mpi4py` (a rank that fails aborts the whole job instead of
# hanging); writes bench/results/redundancy.json and the tables to redundancy.md.
#
#   bench/run_redundancy.sh                          # 32 MiB per rank, fsync off and on, >= 5 rounds
#   RANKS=4 OUT=/tmp/r4.json bench/run_redundancy.sh --lose 1   # other rank counts, other flags
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
mpiexec=${MPIEXEC:-$(dirname "$py")/mpiexec}
n=${RANKS:-8}
limit=${TIMEOUT:-600}  # seconds for the launch
out=${OUT:-bench/results/redundancy.json}
timeout -k 5 "$limit" "$mpiexec" -n "$n" "$py" -m mpi4py bench/bench_redundancy.py --out "$out" "$@"
"$py" bench/bench_redundancy.py --table "$out" > "${out%.json}.md"
echo "# wrote ${out%.json}.md"
