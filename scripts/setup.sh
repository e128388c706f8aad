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
fi
# A regular install puts ckptfmt_zarr_dtypes.pth into site-packages (see setup.py and
# ckptfmt/zarr_plugin.py); pip's editable installs drop it, so put it there ourselves.
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp tools/ckptfmt_zarr_dtypes.pth "$site/"
