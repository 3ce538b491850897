#!/usr/bin/env bash
# Creates .venv with torch 2.13.0 (CPU build) and mlcheckpoint installed in editable mode.
# Idempotent: a second run only checks that everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
    # Pinned before anything else: an unpinned torch would pull several GB of CUDA packages.
    python -m pip install -q --disable-pip-version-check torch==2.13.0
fi
python -m pip install -q --disable-pip-version-check -e ".[test]"
