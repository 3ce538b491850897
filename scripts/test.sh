#!/usr/bin/env bash
# Sets everything up, then checks lint and types and runs the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
. .venv/bin/activate
ruff check mlcheckpoint tests benchmarks examples scripts
mypy mlcheckpoint
exec python -m pytest "$@"
