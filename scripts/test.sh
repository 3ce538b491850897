#!/usr/bin/env bash
# Sets everything up, then checks lint and types and runs the test suite.
# MLCHECKPOINT_TEST_WORKERS=N runs the tests on N parallel pytest-xdist workers (default 3, CI
# too; 0: in one process). With the suite's nodes forked (tests/README.md, Forked launches) its
# tests mostly wait, on timeouts and on each other's processes: 3 workers on 2 cores took the
# suite from 17.3 to 10.2 minutes.
# Arguments go to pytest (e.g. -m "not slow", a file, -k); a -n of their own wins.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
. .venv/bin/activate
ruff check mlcheckpoint tests benchmarks examples scripts
mypy mlcheckpoint
workers=${MLCHECKPOINT_TEST_WORKERS:-3}
if [ "$workers" = 0 ]; then
    exec python -m pytest "$@"
fi
# loadscope: a module's tests stay on one worker, so a launch its tests share (a module-scoped
# fixture) runs once; tests/conftest.py orders the longest modules first, an order
# --no-loadscope-reorder keeps. Then the tests marked `quiet` (pyproject.toml) run alone: they
# time the kernel's network path, which the workers' load would distort.
passes=()
MLCHECKPOINT_TEST_PHASE=parallel python -m pytest -n "$workers" --dist loadscope \
    --no-loadscope-reorder "$@" || passes+=($?)
MLCHECKPOINT_TEST_PHASE=quiet python -m pytest "$@" -n 0 || passes+=($?)
# 5 is pytest's "no test selected" (e.g. -m "not slow" selects no quiet test): a failure only
# when both passes selected nothing.
rc=0
for code in "${passes[@]}"; do
    if [ "$code" != 5 ]; then rc=$code; fi
done
if [ "$rc" = 0 ] && [ "${#passes[@]}" = 2 ]; then rc=5; fi
exit "$rc"
