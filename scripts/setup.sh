#!/usr/bin/env bash
# Creates .venv with torch 2.13.0 (CPU build) and mlcheckpoint installed in editable mode: all
# the demo needs. `scripts/setup.sh --test` adds what the test suite needs: pytest and the
# linters, and the frameworks whose integrations it tests (tests/test_integration_*.py).
# Idempotent: a second run only checks that everything is there. Reads no standard input.
set -euo pipefail
cd "$(dirname "$0")/.."
for_tests=0
if [ "${1:-}" = "--test" ]; then for_tests=1; fi
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ] || [ ! -f .venv/bin/activate ]; then
    rm -rf .venv  # (absent, or left half made by an interrupted run)
    "$PY" -m venv .venv
fi
. .venv/bin/activate
pip_install() { python -m pip install -q --disable-pip-version-check "$@"; }
if ! python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
    # Pinned before anything else: an unpinned torch would pull several GB of CUDA packages.
    pip_install torch==2.13.0
fi
# Everything after this holds torch at the build above: a dependency asking for another torch
# is refused instead of replacing it with a CUDA build.
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
# (Read from its metadata: importing torch before numpy is installed prints a warning.)
python -c "import importlib.metadata as m; print('torch==' + m.version('torch').split('+')[0])" > "$constraints"
# Our own sources compiled ahead, as pip compiles an installed package's: where
# PYTHONDONTWRITEBYTECODE is set (these machines set it), every process would otherwise compile
# the package again as it imports it, about 0.3 CPU-s of each launch's rank and agent. A source
# changed later is compiled again in memory (its bytecode no longer matches), so none is stale.
compile_sources() { python -m compileall -q -j 0 "$@" >/dev/null; }
if [ "$for_tests" = 0 ]; then
    pip_install -c "$constraints" -e .
    compile_sources mlcheckpoint examples
    exit 0
fi
# Lightning and accelerate come with their real dependencies (pyproject.toml's extras); the
# test extra brings torchao (tensor subclasses), whose torch requirement the constraints hold.
pip_install -c "$constraints" -e ".[test,lightning,accelerate]"
# torchtitan 0.3.0 declares its whole trainer's dependencies (datasets, wandb, tensorboard,
# torchdata, torch_checkpointing, ... about 50 packages); its checkpointer, which the tests
# drive, needs only tyro. So the package goes into a folder of its own, outside the
# environment's site-packages: pip's resolver never sees it half-installed, and
# tests/jobs/test_integration_torchtitan.py puts it on PYTHONPATH for the processes it starts.
titan=.venv/torchtitan-0.3.0
if python -c "import importlib.metadata as m; m.version('torchtitan')" 2>/dev/null; then
    # Put there by an earlier version of this script, without its dependencies.
    python -m pip uninstall -q -y --disable-pip-version-check torchtitan
fi
if [ ! -f "$titan/torchtitan/components/checkpointer/dcp.py" ]; then
    rm -rf "$titan"
    pip_install --no-deps --target "$titan" torchtitan==0.3.0
fi
if ! python -c "import importlib.metadata as m, sys; sys.exit(m.version('tyro') != '1.0.17')" 2>/dev/null; then
    pip_install -c "$constraints" tyro==1.0.17
fi
compile_sources mlcheckpoint tests benchmarks examples scripts
