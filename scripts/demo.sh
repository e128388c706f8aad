#!/usr/bin/env bash
# Set everything up, then run the demo: save a model-sized state, inspect, verify, damage, verify.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python examples/demo.py "$@"
