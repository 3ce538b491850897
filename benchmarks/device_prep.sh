#!/usr/bin/env bash
# Before benchmarks/device_check.sh, here (no GPU needed): puts the baseline's package into
# .baseline/ (git-ignored), which the device call carries: run(..., carry=[".baseline"]).
# The device machine gets a copy of the working tree, not the repository, so the baseline
# revision travels as files. REF (default: the revision before wsum64 was added, i.e. the
# host-hashing path the issue measured) names it.
set -euo pipefail
cd "$(dirname "$0")/.."
ref=${1:-$(git log --diff-filter=A --format=%H -1 -- mlcheckpoint/integrity/wsum.py)^}
rm -rf .baseline
mkdir -p .baseline
git archive "$ref" mlcheckpoint setup.py pyproject.toml README.md | tar -x -C .baseline
echo "$(git rev-parse "$ref")" > .baseline/REVISION
echo "baseline $(cat .baseline/REVISION) in .baseline/ ($(du -sh .baseline | cut -f1))"
