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
# Framework integrations, for their tests (tests/test_integration_*.py). Pinned, and torch held
# at the build above: torchtitan without its trainer's dependencies (its checkpointer needs only
# tyro), Lightning with a constraint so it cannot replace torch with a CUDA build.
if ! python -c "import importlib.metadata as m, sys; sys.exit([m.version(p) for p in ('torchtitan', 'tyro', 'lightning')] != ['0.3.0', '1.0.17', '2.6.6'])" 2>/dev/null; then
    constraints=$(mktemp)
    trap 'rm -f "$constraints"' EXIT
    python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > "$constraints"
    python -m pip install -q --disable-pip-version-check --no-deps torchtitan==0.3.0
    python -m pip install -q --disable-pip-version-check -c "$constraints" tyro==1.0.17 lightning==2.6.6
fi
