#!/usr/bin/env bash
# Sets everything up, then checks lint and types and runs the test suite.
# MLCHECKPOINT_TEST_WORKERS=N runs the tests on N parallel pytest-xdist workers; the default, 0,
# runs them in one process (CI). The suite is CPU-bound: on 2 cores workers gain little or
# nothing (2 workers: none, the same tests costing 9% more CPU; tests/README.md, Running).
# Arguments go to pytest (e.g. -m "not slow", a file, -k); a -n of their own wins.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
. .venv/bin/activate
ruff check mlcheckpoint tests benchmarks examples scripts
mypy mlcheckpoint
workers=${MLCHECKPOINT_TEST_WORKERS:-0}
parallel=()
if [ "$workers" != 0 ]; then
    # loadscope: a module's tests stay on one worker, so a launch its tests share (a
    # module-scoped fixture) runs once; tests/conftest.py orders the longest modules first,
    # an order --no-loadscope-reorder keeps.
    parallel=(-n "$workers" --dist loadscope --no-loadscope-reorder)
fi
exec python -m pytest "${parallel[@]}" "$@"
