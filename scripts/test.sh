#!/usr/bin/env bash
# Sets everything up, then checks lint and types and runs the test suite.
# The tests run on parallel workers (pytest-xdist): MLCHECKPOINT_TEST_WORKERS of them (default
# 3 for 2 cores: most slow tests wait on processes they started; not yet tuned on a quiet
# machine), 0 for one process. Arguments go to pytest (e.g. -m "not slow", a file, -k); a -n of their own wins.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
. .venv/bin/activate
ruff check mlcheckpoint tests benchmarks examples scripts
mypy mlcheckpoint
workers=${MLCHECKPOINT_TEST_WORKERS:-3}
parallel=()
if [ "$workers" != 0 ]; then
    # loadscope: a module's tests stay on one worker, so a launch its tests share (a
    # module-scoped fixture) runs once; tests/conftest.py orders the longest modules first,
    # an order --no-loadscope-reorder keeps.
    parallel=(-n "$workers" --dist loadscope --no-loadscope-reorder)
fi
exec python -m pytest "${parallel[@]}" "$@"
