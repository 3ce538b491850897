#!/usr/bin/env bash
# Issue 37 on one lent GPU machine, in one call (about 7 minutes on an H100; the device budget
# is 15 minutes, start included). Here first: benchmarks/device_prep.sh. Then, with the device
# tool: run(command="bash benchmarks/device_check.sh", carry=[".baseline"], timeout_s=590).
#
# In order, each step bounded by its own timeout (together 560 s plus the builds) so a slow one
# leaves the rest their time; a benchmark cut short still writes the sections it finished:
#   1. builds the C extension of this checkout and of the baseline (.baseline/);
#   2. the GPU tests (pytest -m "gpu and not slow": device digests equal the host's, a CUDA
#      save costs the host no byte and resumes through the ring, a corrupt item is refused);
#   3. bench_gpu.py, this checkout: digest engines, D2H staging, fresh-process resume, the
#      training loop at 24/12/6/2 GB/s (no checkpoint, ours with guard, DCP's DefaultStager +
#      FileSystemWriter), the copy threads with 4 and 8 ranks per node;
#   4. bench_gpu.py --package .baseline: D2H, resume and the guarded training loop of the
#      baseline revision, on the same card, with step 3's calibration (the same steps);
#   5. the summary of both (bench_gpu.py --summarize).
# Everything lands in $OUT: after.json, baseline.json, summary.json, tests.log, after.log,
# baseline.log, machine.txt.
set -u
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
EXTRA=${BENCH_EXTRA:-}  # a rehearsal without a GPU: BENCH_EXTRA="--device cpu --quick"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
t0=$(date +%s)
say() { echo "[device_check +$(( $(date +%s) - t0 ))s] $*"; }

{ nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current,driver_version --format=csv
  nproc; free -g; df -h /dev/shm; $PY -c "import torch; print('torch', torch.__version__)"; } > "$OUT/machine.txt" 2>&1
say "building the C extensions"
$PY setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || say "this checkout's C extension did not build"
if [ -d .baseline/mlcheckpoint ]; then
    (cd .baseline && $PY setup.py build_ext --inplace) >> "$OUT/build.log" 2>&1 || say "the baseline's C extension did not build"
else
    say "no .baseline/ (run benchmarks/device_prep.sh and carry it): the baseline is skipped"
fi

say "GPU tests"
timeout 120 $PY -m pytest -q -p no:cacheprovider -m "gpu and not slow" tests/integrity tests/dcp \
    > "$OUT/tests.log" 2>&1
say "GPU tests: exit $? ($(tail -1 "$OUT/tests.log"))"

say "bench_gpu, this checkout"
timeout 300 $PY benchmarks/bench_gpu.py --size-gb 4 $EXTRA --json "$OUT/after.json" > "$OUT/after.log" 2>&1
say "bench_gpu: exit $?"

if [ -d .baseline/mlcheckpoint ] && [ -f "$OUT/after.json" ]; then
    calibration=$($PY -c "import json,sys; t=json.load(open(sys.argv[1])).get('train') or {}; \
print(f\"--micro-batch {t['micro_batch']} --accums {t['accums']}\" if t else '')" "$OUT/after.json")
    say "bench_gpu, the baseline ($(cat .baseline/REVISION 2>/dev/null)) $calibration"
    timeout 140 $PY benchmarks/bench_gpu.py --package .baseline --only d2h,h2d,train --modes ours_guard \
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
