#!/usr/bin/env bash
# Sets everything up, then runs the demo: a simulated 2-node job that checkpoints to RAM,
# loses a node, recovers from the partner's replica and matches an uninterrupted run.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
exec python examples/demo.py "$@"
