#!/usr/bin/env bash
# Issues 46 and 37 on one lent GPU machine, in one call (the device budget is 15 minutes, start
# included; one command at most 10). Here first: benchmarks/device_prep.sh. Then, with the device
# tool: run(command="bash benchmarks/device_check.sh", carry=[".baseline", ".before46"],
# timeout_s=590). ONLY=46 runs steps 1-3 alone (about 4 minutes).
#
# In order, each step bounded by its own timeout and all of them by BUDGET seconds (default
# 570) so a slow one leaves the rest their time; a benchmark cut short still writes the
# sections it finished:
#   1. builds the C extension of this checkout and of the baselines (.baseline/, .before46/);
#   2. issue 46's GPU tests (tests/dcp/test_gpu.py, and the registrations and contexts jobs
#      of tests/jobs/test_gpu_jobs.py) on this checkout, then the same tests on the revision
#      before issue 46 (.before46/), where each should fail (both in tests46.log);
#   3. the other GPU tests (pytest -m "gpu and not slow": device digests equal the host's, a
#      CUDA save costs the host no byte and resumes through the ring, a corrupt item is refused);
#   4. bench_gpu.py, this checkout: digest engines, D2H staging, fresh-process resume, the
#      training loop at 24/12/6/2 GB/s (no checkpoint, ours with guard, DCP's DefaultStager +
#      FileSystemWriter), the copy threads with 4 and 8 ranks per node;
#   5. bench_gpu.py --package .baseline: D2H, resume and the guarded training loop of the
#      baseline revision, on the same card, with step 4's calibration (the same steps);
#   6. the summary of both (bench_gpu.py --summarize).
# Everything lands in $OUT, 8 files (the most that come back): machine.txt, tests46.log,
# tests.log, after.json, baseline.json, summary.json, after.log, baseline.log. The builds' log
# stays in /tmp/build.log; its tail is printed when a build fails.
set -u
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
EXTRA=${BENCH_EXTRA:-}  # a rehearsal without a GPU: BENCH_EXTRA="--device cpu --quick"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
t0=$(date +%s)
BUDGET=${BUDGET:-570}
say() { echo "[device_check +$(( $(date +%s) - t0 ))s] $*"; }
# A step's timeout: its own, or what is left of the budget less ``reserve`` for later steps.
limit() {
    local own=$1 reserve=${2:-0} left
    left=$(( BUDGET - ($(date +%s) - t0) - reserve ))
    (( left < own )) && own=$left
    (( own < 1 )) && own=1
    echo "$own"
}
TESTS46=(tests/dcp/test_gpu.py
         tests/jobs/test_gpu_jobs.py::test_saves_with_replication_page_lock_no_buffer_again_once_they_are_made
         tests/jobs/test_gpu_jobs.py::test_a_rank_on_cuda_1_makes_no_context_on_device_0)

{ nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current,driver_version --format=csv
  nproc; free -g; df -h /dev/shm; $PY -c "import torch; print('torch', torch.__version__)"; } > "$OUT/machine.txt" 2>&1
say "building the C extensions"
BUILD_LOG=/tmp/build.log
$PY setup.py build_ext --inplace > $BUILD_LOG 2>&1 || { say "this checkout's C extension did not build"; tail -5 $BUILD_LOG; }
for base in .baseline .before46; do
    if [ -d $base/mlcheckpoint ]; then
        (cd $base && $PY setup.py build_ext --inplace) >> $BUILD_LOG 2>&1 || { say "$base: its C extension did not build"; tail -5 $BUILD_LOG; }
    else
        say "no $base/ (run benchmarks/device_prep.sh and carry it): what needs it is skipped"
    fi
done

say "issue 46: GPU tests, this checkout"
{ echo "=== this checkout"; PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout "$(limit 150)" \
    $PY -m pytest -q -p no:cacheprovider -m gpu -rfEs "${TESTS46[@]}"; } > "$OUT/tests46.log" 2>&1
say "issue 46, this checkout: exit $? ($(tail -1 "$OUT/tests46.log"))"
if [ -d .before46/mlcheckpoint ]; then
    # From inside .before46/, whose package then comes first on the path (the workers' too):
    # this checkout's tests against the code before issue 46.
    say "issue 46: the same tests on the revision before it ($(cat .before46/REVISION 2>/dev/null))"
    echo "=== the revision before issue 46: $(cat .before46/REVISION 2>/dev/null)" > /tmp/tests46_before.log
    (cd .before46 && PYTHONPATH="$PWD" timeout "$(limit 120)" $PY -m pytest -q -p no:cacheprovider -m gpu -rfEs \
        --rootdir=.. -c ../pyproject.toml "${TESTS46[@]/#/../}" >> /tmp/tests46_before.log 2>&1)
    say "issue 46, before: exit $? ($(tail -1 /tmp/tests46_before.log))"
    cat /tmp/tests46_before.log >> "$OUT/tests46.log"
fi
[ "${ONLY:-}" = 46 ] && { say "done (ONLY=46)"; exit 0; }

say "GPU tests"
timeout "$(limit 120 300)" $PY -m pytest -q -p no:cacheprovider -m "gpu and not slow" tests/integrity tests/dcp \
    --ignore=tests/dcp/test_gpu.py > "$OUT/tests.log" 2>&1
say "GPU tests: exit $? ($(tail -1 "$OUT/tests.log"))"

say "bench_gpu, this checkout"
timeout "$(limit 300 100)" $PY benchmarks/bench_gpu.py --size-gb 4 $EXTRA --json "$OUT/after.json" > "$OUT/after.log" 2>&1
say "bench_gpu: exit $?"

if [ -d .baseline/mlcheckpoint ] && [ -f "$OUT/after.json" ]; then
    calibration=$($PY -c "import json,sys; t=json.load(open(sys.argv[1])).get('train') or {}; \
print(f\"--micro-batch {t['micro_batch']} --accums {t['accums']}\" if t else '')" "$OUT/after.json")
    say "bench_gpu, the baseline ($(cat .baseline/REVISION 2>/dev/null)) $calibration"
    timeout "$(limit 140 10)" $PY benchmarks/bench_gpu.py --package .baseline --only d2h,h2d,train --modes ours_guard \
        --size-gb 4 $EXTRA $calibration --json "$OUT/baseline.json" > "$OUT/baseline.log" 2>&1
    say "bench_gpu baseline: exit $?"
fi

if [ -f "$OUT/after.json" ]; then
    baseline=""
    [ -f "$OUT/baseline.json" ] && baseline="$OUT/baseline.json"
    $PY benchmarks/bench_gpu.py --summarize "$OUT/summary.json" "$OUT/after.json" $baseline
fi
tail -c 3000 "$OUT/after.log"
say "done"
