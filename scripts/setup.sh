#!/usr/bin/env bash
# Create .venv in the repository and install the pinned development environment plus ckptfmt
# (editable). Idempotent: skips pip when requirements and pyproject are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
stamp=.venv/.ckptfmt-setup-stamp
want=$(cat requirements/dev.txt pyproject.toml setup.py | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q -r requirements/dev.txt
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
  echo "$want" > "$stamp"
  echo "ckptfmt is installed in .venv: 'source .venv/bin/activate' puts its python and ckptfmt on PATH"
fi
# pip installs ckptfmt_zarr_dtypes.pth, the start-up hook that teaches plain zarr bfloat16, into
# site-packages, from a wheel and an editable install alike (setup.py); say so when it is missing.
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ ! -f "$site/ckptfmt_zarr_dtypes.pth" ]; then
  echo "setup.sh: $site/ckptfmt_zarr_dtypes.pth is missing after 'pip install -e .';" \
    "remove $stamp and run scripts/setup.sh again" >&2
  exit 1
fi
