#!/usr/bin/env bash
# Sets everything up, then runs the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
exec python -m pytest "$@"
