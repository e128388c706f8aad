#!/usr/bin/env bash
# Set everything up, then run the demo: PyTorch DDP on 4 ranks over 2 simulated nodes loses a node
# and resumes bitwise from XOR parity; then a model-sized state saved, inspected, verified, damaged.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python examples/demo.py "$@"
