#!/usr/bin/env bash
# Set everything up, then run the whole test suite (slow, MPI, torch and TensorFlow tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export TF_CPP_MIN_LOG_LEVEL=2
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
