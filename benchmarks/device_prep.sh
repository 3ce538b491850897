#!/usr/bin/env bash
# Before benchmarks/device_check.sh, here (no GPU needed): puts two earlier revisions' packages
# into git-ignored folders, which the device call carries: run(..., carry=[".baseline", ".before46"]).
# The device machine gets a copy of the working tree, not the repository, so a baseline
# revision travels as files.
#   .baseline/  REF (argument 1; default: the revision before wsum64 was added, i.e. the
#               host-hashing path issue 37 measured): bench_gpu.py's baseline;
#   .before46/  REF46 (argument 2; default: the revision before issue 46's fixes, the parent of
#               the commit that added ``wsum.scratch_bytes``): the GPU tests of issue 46 run
#               against it too, to show that each fails there.
set -euo pipefail
cd "$(dirname "$0")/.."
ref=${1:-$(git log --diff-filter=A --format=%H -1 -- mlcheckpoint/integrity/wsum.py)^}
ref46=${2:-$(git log --format=%H -S 'def scratch_bytes' -- mlcheckpoint/integrity/wsum.py | tail -1)^}
for pair in ".baseline:$ref" ".before46:$ref46"; do
    dir=${pair%%:*}
    rev=${pair#*:}
    rm -rf "$dir"
    mkdir -p "$dir"
    git archive "$rev" mlcheckpoint setup.py pyproject.toml README.md | tar -x -C "$dir"
    git rev-parse "$rev" > "$dir/REVISION"
    echo "$dir: $(cat "$dir/REVISION") ($(du -sh "$dir" | cut -f1))"
done
