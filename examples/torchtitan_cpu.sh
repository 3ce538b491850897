#!/usr/bin/env bash
# torchtitan 0.3.0's real trainer on CPU (llama3 debug model, FSDP2 over gloo, 2 simulated nodes)
# with mlcheckpoint's checkpointer: a node dies and comes back empty, then both do; each resume
# must end exactly where an uninterrupted run does. Not part of CI (it installs torchtitan's
# full dependencies and takes a few minutes). See examples/torchtitan_cpu.py for the steps.
#
#   examples/torchtitan_cpu.sh
#
# Settings: VENV (default .venv-torchtitan; torch 2.13.0 CPU, torchtitan and its dependencies,
# mlcheckpoint), TORCH_INDEX (a pip index serving CPU builds, e.g.
# https://download.pytorch.org/whl/cpu, if your default index serves CUDA ones), TORCHTITAN_SRC
# (a torchtitan checkout for its tokenizer test asset; cloned when unset), KEEP=1 keeps the
# work directory (logs, checkpoints).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-torchtitan}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
. "$VENV/bin/activate"
python -m pip install -q torch==2.13.0 ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
constraints=$(mktemp)
python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > "$constraints"
python -m pip install -q -c "$constraints" torchtitan==0.3.0 -e .
rm -f "$constraints"

work=$(mktemp -d /dev/shm/mlckpt-titan-XXXXXX)  # node memories (tmpfs) and torchtitan's folders
if [ "${KEEP:-0}" != 1 ]; then trap 'rm -rf "$work"' EXIT; fi
src=${TORCHTITAN_SRC:-}
if [ -z "$src" ]; then
    src="$work/torchtitan-src"
    git clone -q --depth 1 --filter=blob:none --sparse https://github.com/pytorch/torchtitan "$src"
    git -C "$src" sparse-checkout set tests/assets/tokenizer
fi
mkdir -p "$work/tests/assets/c4_test"
cp -r "$src/tests/assets/tokenizer" "$work/tests/assets/"
# A small synthetic corpus in c4_test's place (the debug config reads tests/assets/c4_test).
python - "$work/tests/assets/c4_test/data.json" <<'PY'
import json, random, sys
rng = random.Random(0)
words = ("the of and to in is was for on that with as by at from his her it an are were be "
         "this which or have had not one all their there been if more when will would").split()
with open(sys.argv[1], "w") as f:
    for _ in range(2000):
        f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(300))}) + "\n")
PY
python examples/torchtitan_cpu.py --workdir "$work"
