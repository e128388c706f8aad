#!/usr/bin/env bash
# Simulated hosts on this machine (root): N hosts, each with its own network namespace and
# address, host name and node-local folder (/local/ckpt), plus a shared folder; runs one command
# on every host, or an MPI job across them with --mpi, then removes everything.
#   scripts/hosts.sh -n 3                       # a tour: each host names itself and its folder
#   scripts/hosts.sh -n 4 --mpi -- .venv/bin/python -m mpi4py my_job.py
# The shared folder's path is in $HOSTSIM_SHARED. See tests/hostsim.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
exec "$PY" tests/hostsim.py "$@"
